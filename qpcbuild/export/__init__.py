"""Checkpoint -> ONNX graph (one graph per model, used by every specialization and backend).

`export_model` streams the weights into `model.onnx.data` while the decoder graph is written:
each tensor is memory-mapped from the checkpoint and written in blocks of at most 64 MiB, so
memory stays small whatever the model's size (the page cache holds the rest). The output folder
appears complete or not at all.

Names are imported when first used (as in bundle/__init__.py): a compile whose exports are all
cache hits needs the file names below, not onnx, whose import was most of its start-up.
"""

from importlib import import_module

OPSET = 17  # the ONNX opset every graph of ours is written in (and whose schemas are read)
GRAPH_FILE, DATA_FILE = "model.onnx", "model.onnx.data"
MS = "com.microsoft"  # ONNX Runtime's contrib-operator domain (MatMulNBits, MoE, GQA)
EAGLE3_DIR = "eagle3"  # an EAGLE-3 head's graph, in a folder beside its target's artifact
# the target artifact's token embedding, whose rows a head graph without a copy of its own
# takes as `inputs_embeds` (backends/onnxruntime/eagle3_graph.py)
TARGET_EMBEDDING = "model.embed_tokens.weight"

_WHERE = {"export_model": "model", "ExportResult": "model"}

__all__ = ["DATA_FILE", "EAGLE3_DIR", "GRAPH_FILE", "MS", "OPSET", "TARGET_EMBEDDING",
           *sorted(_WHERE)]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)

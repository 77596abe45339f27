"""A mixture-of-experts model's ONNX Runtime graph: the exported graph rebuilt with each routed
layer as one com.microsoft.MoE node (export/experts.py, `routed_by_moe_op`).

The card graph runs every expert on every token (QEfficient's dense form): exact, and E times a
dense MLP's work. ONNX Runtime's CPU MoE kernel runs only the k experts each token chose, with
the same routing and SwiGLU, so the onnxruntime artifact of a MoE model is built from this
graph instead. It is rebuilt by the same decoder, from the exported graph's own tensors: each
one is referenced where the export wrote it (same file, same offset), so nothing is copied
here; the few tables the decoder computes (RoPE, a vocabulary subset's) go to a file of their
own beside it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...export import DATA_FILE, GRAPH_FILE, MS, OPSET
from ...export.builder import GraphBuilder, weight_key
from ...export.decoder import SUBSET_KEPT, Decoder
from ...models.arch import ArchSpec
from .plan import MOE_FORM

TABLES_FILE = "model.onnx.tables"  # the rebuilt graph's own small tensors


def rebuild_with_moe_op(export_dir: Path, out_dir: Path, arch: ArchSpec) -> Path:
    """Write `out_dir/model.onnx`: the graph exported in `export_dir`, its routed layers as
    MoE nodes. Its weights are read from `out_dir/model.onnx.data`, which must hold the same
    bytes as the export's (a hard link or a copy; ONNX Runtime refuses a symlink)."""
    source = onnx.load(str(export_dir / GRAPH_FILE), load_external_data=False)
    metadata = {p.key: p.value for p in source.metadata_props}
    exported = {t.name: t for t in source.graph.initializer
                if t.data_location == TensorProto.EXTERNAL}
    subset = None
    if SUBSET_KEPT in exported:  # a draft's vocabulary subset: its kept token ids
        from .weights import PortableWeights

        subset = np.flatnonzero(PortableWeights(export_dir / GRAPH_FILE).get(SUBSET_KEPT))
    with open(out_dir / TABLES_FILE, "wb") as tables:
        g = GraphBuilder(tables, TABLES_FILE)
        loaded: dict[str, str] = {}

        def load(name: str, shape: tuple[int, ...], transpose: bool,
                 rows: np.ndarray | None = None, offset: float = 0.0) -> str:
            key = weight_key(name, transpose, rows is not None, offset)
            if key not in loaded:
                tensor = TensorProto()
                tensor.CopyFrom(exported[key])  # still located in DATA_FILE
                assert {e.key: e.value for e in tensor.external_data}["location"] == DATA_FILE
                g.initializers.append(tensor)
                # a float16 export's weights are Cast where they are used, as exported
                loaded[key] = key if tensor.data_type == TensorProto.FLOAT else \
                    g.op("Cast", key, to=TensorProto.FLOAT)
            return loaded[key]

        Decoder(g, arch, load, subset, moe_op=True).build(
            metadata["role"], metadata["continuous_batching"] == "true")
    model = g.model(source.graph.name, OPSET, {**metadata, "experts": MOE_FORM})
    model.opset_import.append(helper.make_opsetid(MS, 1))
    path = out_dir / GRAPH_FILE
    path.write_bytes(model.SerializeToString(deterministic=True))
    return path

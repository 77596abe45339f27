"""Record the form of QEfficient's own card graphs into qpcbuild/data/qefficient_dialect.json.

`qpcbuild doctor` is calibrated on this file: what QEfficient exports for each family and role
is what the Cloud AI compiler is proven on. CI reads only the fixture; this script regenerates it
and needs QEfficient, which is not a qpcbuild dependency. Run it in a private environment:

    python3 -m venv /work/qeff-venv    # QEfficient's pins: transformers 5.5.4, onnx 1.18.0,
    ...                                # onnxruntime 1.22.0, onnxscript 0.2.5, numpy 1.26.4, torch
    /work/qeff-venv/bin/python scripts/record_qeff_dialect.py
        [--smollm2 models/smollm2-135m-instruct --only smollm2]   # ~5 GiB: on its own
        [--keep DIR]    # also keep the exported graphs (without weights) there

It exports small random Llama / Qwen2 / Qwen3 / Mistral models (and SmolLM2-135M when given) as a
TLM target (num_logits_to_keep input, verifying K+1 tokens), a draft (plain causal LM), and both
again with continuous batching, then writes each graph's form (qpcbuild/export/graph_form.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "qpcbuild" / "data" / "qefficient_dialect.json"
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, intermediate_size=128, max_position_embeddings=512)


def _graph_form():
    """qpcbuild/export/graph_form.py by path: qpcbuild itself is not installed here."""
    spec = importlib.util.spec_from_file_location("graph_form", REPO / "qpcbuild" / "export" /
                                                  "graph_form.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.graph_form


def families():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {"llama": LlamaConfig(**SHAPE, tie_word_embeddings=True),
            "qwen2": Qwen2Config(**SHAPE, tie_word_embeddings=False),
            "qwen3": Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=False),
            "mistral": MistralConfig(**SHAPE, head_dim=16, tie_word_embeddings=False)}


VARIANTS = {"target": (False, True), "draft": (False, False), "target_cb": (True, True),
            "draft_cb": (True, False)}


def export(model_factory, variant: str, out: Path) -> Path:
    from QEfficient import QEFFAutoModelForCausalLM

    cb, tlm = VARIANTS[variant]
    qaic_config = {"speculative_model_type": "target"} if tlm else None
    qeff = QEFFAutoModelForCausalLM(model_factory(), continuous_batching=cb,
                                    qaic_config=qaic_config)
    return Path(qeff.export(export_dir=str(out)))


def without_weights(model):
    """The graph with every initializer over 16 elements pointing at an absent external file:
    what `doctor` reads (it never loads weights), a few kB instead of the weights' size."""
    from onnx import TensorProto

    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        if n > 16 and t.data_location != TensorProto.EXTERNAL:
            t.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data"):
                t.ClearField(field)
            t.data_location = TensorProto.EXTERNAL
            entry = t.external_data.add()
            entry.key, entry.value = "location", "weights-not-kept"
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", type=Path, help="SmolLM2-135M checkpoint folder")
    ap.add_argument("--keep", type=Path, help="copy each exported model.onnx (no weights) here")
    ap.add_argument("--out", type=Path, default=FIXTURE)
    ap.add_argument("--snapshot", default="unknown",
                    help="the efficient-transformers commit installed (it has no version file)")
    ap.add_argument("--only", nargs="*", help="record these families only, keeping the file's "
                    "other entries (SmolLM2's export needs ~5 GiB: run it on its own)")
    args = ap.parse_args()

    import onnx
    import QEfficient
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    graph_form = _graph_form()
    factories = {}
    for name, config in families().items():
        def make(config=config):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        factories[name] = make
    if args.smollm2:
        factories["smollm2"] = lambda: AutoModelForCausalLM.from_pretrained(
            args.smollm2, dtype=torch.float32).eval()

    graphs: dict[str, dict] = {}
    unsupported: dict[str, str] = {}
    if args.only:
        old = json.loads(args.out.read_text())
        graphs = {k: v for k, v in old["graphs"].items() if k.split("/")[0] not in args.only}
        unsupported = {k: v for k, v in old.get("unsupported", {}).items()
                       if k.split("/")[0] not in args.only}
        factories = {k: v for k, v in factories.items() if k in args.only}
    with tempfile.TemporaryDirectory() as tmp:
        for family, factory in factories.items():
            for variant in VARIANTS:
                try:
                    path = export(factory, variant, Path(tmp) / family / variant)
                except NotImplementedError as exc:  # Mistral: no TLM in QEfficient
                    unsupported[f"{family}/{variant}"] = str(exc)
                    print(f"{family}/{variant}: {exc}", file=sys.stderr)
                    continue
                model = onnx.load(str(path), load_external_data=False)
                graphs[f"{family}/{variant}"] = graph_form(model)
                if args.keep:
                    dest = args.keep / family / variant
                    dest.mkdir(parents=True, exist_ok=True)
                    (dest / "model.onnx").write_bytes(without_weights(model).SerializeToString())
                nodes = sum(sum(c.values()) for c in graphs[f"{family}/{variant}"]["top_level"]
                            .values())
                print(f"{family}/{variant}: {nodes} nodes", file=sys.stderr)
    record = {"source": {"qefficient": QEfficient.__version__, "snapshot": args.snapshot,
                         "transformers":
                         transformers.__version__, "onnx": onnx.__version__,
                         "torch": torch.__version__, "export": "QEFFAutoModelForCausalLM.export"
                         " (TorchScript), TLM targets via qaic_config speculative_model_type"},
              "graphs": dict(sorted(graphs.items())),
              "unsupported": dict(sorted(unsupported.items()))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

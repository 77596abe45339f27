"""Mixture of experts on ONNX Runtime: the card's dense form against the MoE kernel's, and the
export's peak memory with few and many experts.

What it measures
----------------
``speed``: a random Qwen3-MoE checkpoint written here with transformers' own classes (4 layers,
hidden 384, 16 experts of width 384, top 2, vocabulary 1024; nothing is downloaded) is exported
once; both ONNX Runtime graphs are made from that one export as `qpcbuild compile` makes them
(the dense one is the export with fixed dims, the other is rebuilt with one com.microsoft.MoE
node per routed layer, backends/onnxruntime/moe.py) and run in this process, one thread each,
calls alternating between the two: a decode step (1 token), a verify window (4 tokens) and a
prefill chunk (32 tokens), each the median of `--repeats` calls after a warm-up. Both graphs'
logits are compared on the same inputs.

``memory``: the same shape with 2 layers and hidden 256, exported by `export_model` in a child
process per case, with 4 and with 64 experts; each child reports its peak RSS (VmHWM).

How to run (repository root, the project's venv):
    PYTHONPATH=$PWD python benchmarks/moe_forms.py speed [--repeats 30]
    PYTHONPATH=$PWD python benchmarks/moe_forms.py memory
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_checkpoint(folder: Path, layers: int, hidden: int, experts: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=hidden // 8,
                            intermediate_size=hidden, moe_intermediate_size=hidden,
                            num_experts=experts, num_experts_per_tok=2, vocab_size=1024,
                            max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def sessions(export_dir: Path, work: Path, ctx_len: int):
    """The dense and the MoE-kernel graph of one export, each with dims fixed, as sessions."""
    import onnxruntime as ort

    from qpcbuild.backends.onnxruntime.build import fix_dims
    from qpcbuild.backends.onnxruntime.moe import rebuild_with_moe_op
    from qpcbuild.export import DATA_FILE, GRAPH_FILE
    from qpcbuild.models.arch import arch_from_config

    arch = arch_from_config(json.loads((export_dir.parent / "model" / "config.json").read_text()))
    out = {}
    for form in ("dense", "moe"):
        folder = work / form
        folder.mkdir()
        os.link(export_dir / DATA_FILE, folder / DATA_FILE)
        graph = export_dir / GRAPH_FILE if form == "dense" else \
            rebuild_with_moe_op(export_dir, folder, arch)
        fix_dims(graph, {"batch_size": 1, "ctx_len": ctx_len}, folder / GRAPH_FILE)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        out[form] = ort.InferenceSession(str(folder / GRAPH_FILE), opts,
                                         providers=["CPUExecutionProvider"])
    return arch, out


def speed(repeats: int) -> dict:
    from qpcbuild.export import export_model
    from qpcbuild.models.source import resolve

    ctx_len = 256
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_checkpoint(root / "model", layers=4, hidden=384, experts=16)
        res = export_model(resolve(str(model)), "target", root / "export")
        arch, sess = sessions(res.onnx_path.parent, root, ctx_len)
        rng = np.random.default_rng(0)
        kv = {f"past_{kind}.{i}": np.zeros((1, arch.num_kv_heads, ctx_len, arch.head_dim),
                                           np.float32)
              for i in range(arch.num_layers) for kind in ("key", "value")}
        results = {}
        for name, seq in (("decode (1 token)", 1), ("verify window (4 tokens)", 4),
                          ("prefill chunk (32 tokens)", 32)):
            feeds = {"input_ids": rng.integers(0, arch.vocab_size, (1, seq)),
                     "position_ids": np.arange(100, 100 + seq)[None],
                     "num_logits_to_keep": np.zeros((seq, 1), np.int64), **kv}
            logits = {f: s.run(["logits"], feeds)[0] for f, s in sess.items()}  # warm-up too
            times: dict[str, list[float]] = {f: [] for f in sess}
            for _ in range(repeats):
                for form, s in sess.items():
                    start = time.perf_counter()
                    s.run(["logits"], feeds)
                    times[form].append(time.perf_counter() - start)
            dense, moe = (float(np.median(times[f])) * 1e3 for f in ("dense", "moe"))
            results[name] = {"dense_ms": round(dense, 3), "moe_kernel_ms": round(moe, 3),
                             "dense_over_moe": round(dense / moe, 2),
                             "max_abs_logit_diff": float(np.abs(logits["dense"] -
                                                                logits["moe"]).max())}
    return {"model": "Qwen3-MoE, 4 layers, hidden 384, 16 experts of width 384, top 2",
            "ctx_len": ctx_len, "threads": 1, "repeats": repeats, "results": results}


def export_peak(experts: int) -> dict:
    """In a child: write a checkpoint, then export it; VmHWM is reset before the export."""
    code = f"""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from moe_forms import write_checkpoint
from qpcbuild.export import export_model
from qpcbuild.models.source import resolve
tmp = Path(tempfile.mkdtemp())
model = write_checkpoint(tmp / "model", layers=2, hidden=256, experts={experts})
import gc; gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
before = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmRSS")))
export_model(resolve(str(model)), "target", tmp / "export")
peak = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")))
size = sum(f.stat().st_size for f in (tmp / "model").iterdir())
print(json.dumps({{"experts": {experts}, "checkpoint_mib": round(size / 2**20, 1),
                  "rss_before_export_mib": round(before / 1024, 1),
                  "export_peak_mib": round(peak / 1024, 1),
                  "export_growth_mib": round((peak - before) / 1024, 1)}}))
import shutil; shutil.rmtree(tmp)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["speed", "memory"])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if args.what == "speed":
        print(json.dumps(speed(args.repeats), indent=2))
    else:
        print(json.dumps([export_peak(n) for n in (4, 64)], indent=2))


if __name__ == "__main__":
    main()

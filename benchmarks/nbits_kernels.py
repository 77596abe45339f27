"""Which MatMulNBits path an int4/int8 target should take: block size, symmetric or asymmetric
grid, accuracy_level (int8 activations or float math), the LM head quantized or not, and what a
verify window of K+1 tokens costs against one token (issue 47).

It builds the recipe's bundle once with the quantized target, exports the target's portable
graph once, then lowers it again per layout into copies of that bundle and opens each copy's
target session exactly as `qpcbuild run` does. All sessions live in one process and are timed
round-robin (each layout in turn, one call per window, `--rounds` times), so a busy machine
slows every layout alike: compare ratios, not absolute times. Also reported per layout: how far
its logits are from the float32 target's (max abs, and top-1 agreement teacher-forced on the
float32 target's greedy outputs for six code prompts).

    python benchmarks/nbits_kernels.py recipes/smollm2.yaml --weights int4 --k 4
    python benchmarks/nbits_kernels.py recipes/smollm2.yaml --weights int8 --json-out n.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POSITION = 300  # KV positions already valid when the timed calls start
PADDED = "1+pad"  # one token padded to a window of 2
PROMPTS = Path(__file__).resolve().parents[1] / "qpcbuild" / "data" / "prompts" / "code.jsonl"


def layouts(weights: str):
    """The candidates: the current default first, then one change at a time, then the pairs
    a single change suggests."""
    from qpcbuild.backends.onnxruntime.nbits import NbitsLayout

    out = {"float32 target": None, "b32 sym acc4 head": NbitsLayout()}
    for block in (64, 128):
        out[f"b{block} sym acc4 head"] = NbitsLayout(block_size=block)
    out["b32 asym acc4 head"] = NbitsLayout(symmetric=False)
    out["b32 sym acc0 head"] = NbitsLayout(accuracy_level=0)
    out["b32 sym acc4 fp32-head"] = NbitsLayout(quantize_head=False)
    out["b128 asym acc4 head"] = NbitsLayout(block_size=128, symmetric=False)
    out["b64 asym acc4 fp32-head"] = NbitsLayout(block_size=64, symmetric=False,
                                                 quantize_head=False)
    for block in (32, 64, 128):  # least-squares scales over the whole grid (scale_search)
        out[f"b{block} searched acc4 head"] = NbitsLayout(block_size=block, scale_search=True)
    return out


def chosen(weights: str, names: list[str] | None) -> dict:
    """The float32 target and the layouts named (all of them without names)."""
    return {n: lay for n, lay in layouts(weights).items()
            if lay is None or names is None or n in names}


def build_variants(recipe: Path, weights: str, k: int, work: Path,
                   names: list[str] | None = None) -> dict[str, Path]:
    import onnx

    from qpcbuild.backends.onnxruntime.ort_graph import PortableWeights, build_ort_graph
    from qpcbuild.bundle import build_bundle
    from qpcbuild.cache import Cache
    from qpcbuild.export import GRAPH_FILE, export_model
    from qpcbuild.models.source import resolve
    from qpcbuild.plan import make_plan
    from qpcbuild.recipe import load_recipe

    plan = make_plan(load_recipe(recipe, [f"onnxruntime.target_weights={weights}",
                                          f"speculation.num_speculative_tokens=[0,{k}]"]))
    base = work / "base"
    build_bundle(plan, cache=Cache(work / "cache"), out=base)
    role = plan.target
    src = resolve(str(role.source.folder()), role.source.revision, allow_known=False)
    export_model(src, "target", work / "export")
    portable = PortableWeights(work / "export" / GRAPH_FILE)
    meta = {p.key: p.value for p in onnx.load(str(work / "export" / GRAPH_FILE),
                                              load_external_data=False).metadata_props}
    out = {}
    for n, (name, layout) in enumerate(chosen(weights, names).items()):
        copy = work / f"v{n}"
        shutil.copytree(base, copy, ignore=shutil.ignore_patterns("model.onnx*"))
        shutil.copytree(base / "draft", copy / "draft", dirs_exist_ok=True)
        build_ort_graph(role.arch, portable, "target", 1, plan.recipe.shapes.ctx_len,
                        copy / "target" / "ort", {**meta, "ort_graph": "fused"},
                        "float32" if layout is None else weights,
                        layout=layout or layouts(weights)["b32 sym acc4 head"])
        out[name] = copy
    return out


def measure(variants: dict[str, Path], k: int, rounds: int, prompts: int = 6,
            new_tokens: int = 48) -> dict:
    """Per layout: its top-1 agreement with the float32 target, teacher-forced on the float32
    target's greedy outputs for the first `prompts` code prompts, and its call times."""
    import qpcbuild
    from qpcbuild.numerics_bench import teacher_forced_logits
    from qpcbuild.prompts import read_prompt_file

    gens = {name: qpcbuild.load(path, verify="none") for name, path in variants.items()}
    fp32 = gens["float32 target"]
    forced = []  # (prompt, fp32 greedy output, fp32 logits) per prompt
    for text in read_prompt_file(PROMPTS)[:prompts]:
        ids = fp32.encode(text)
        row = fp32.generate([ids], new_tokens, target_only=True).rows[0]
        out_ids = row.tokens[len(ids):]
        forced.append((ids, out_ids, teacher_forced_logits(fp32, ids, out_ids, k + 1)))
    result = {}
    for name, gen in gens.items():
        diff, same, n = 0.0, 0, 0
        for ids, out_ids, ref in forced:
            logits = teacher_forced_logits(gen, ids, out_ids, k + 1)
            diff = max(diff, float(np.abs(logits - ref).max()))
            same += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            n += len(ref)
        result[name] = {"max_abs_logit_diff": diff, "top1_agreement": round(same / n, 4),
                        "positions": n, "bytes": sum(f.stat().st_size for f in
                                                     (variants[name] / "target" / "ort").iterdir())}
    # Windows interleaved too: each round runs every layout at 1 token, at 1 token padded to 2
    # (the floor of an int8/int4 target: nbits.TARGET_NBITS) and at K+1 tokens, so load from
    # other processes falls on every window's ratio alike.
    feeds: dict[int | str, tuple[np.ndarray, np.ndarray]] = {w: (np.ones((1, w), np.int64),
                 np.arange(POSITION, POSITION + w, dtype=np.int64).reshape(1, -1))
             for w in (1, k + 1)}
    feeds[PADDED] = (np.ones((1, 2), np.int64), np.array([[POSITION, -1]], np.int64))
    times: dict[tuple[str, int | str], list[float]] = {(n, w): [] for n in gens for w in feeds}
    for gen in gens.values():  # warm-up
        for ids, pos in feeds.values():
            gen.target.run(ids, pos)
    for _ in range(rounds):
        for name, gen in gens.items():
            for w, (ids, pos) in feeds.items():
                t0 = time.perf_counter()
                gen.target.run(ids, pos)
                times[name, w].append(time.perf_counter() - t0)
    for (name, w), ts in times.items():
        result[name][f"ms_{w}"] = round(1e3 * statistics.median(ts), 3)
    base = result["float32 target"]
    for name, r in result.items():
        r["verify_over_decode"] = round(r[f"ms_{k + 1}"] / r["ms_1"], 3)
        r["padded_over_decode"] = round(r[f"ms_{PADDED}"] / r["ms_1"], 3)
        r["decode_speedup_over_fp32"] = round(base["ms_1"] / r["ms_1"], 3)
        r["verify_speedup_over_fp32"] = round(base[f"ms_{k + 1}"] / r[f"ms_{k + 1}"], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--weights", choices=("int4", "int8"), default="int4")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify (window K+1)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--layouts", help="comma list of layout names (default: all)")
    args = ap.parse_args()
    names = args.layouts.split(",") if args.layouts else None
    from qpcbuild.backends.onnxruntime.nbits import NbitsLayout

    work = Path(tempfile.mkdtemp(prefix="qpcbuild-nbits-"))
    try:
        result = measure(build_variants(args.recipe, args.weights, args.k, work, names),
                         args.k, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    w = args.k + 1
    print(f"{args.recipe} {args.weights} target, median of {args.rounds} round-robin calls at "
          f"position {POSITION}")
    print(f"{'layout':26} {'MB':>6} {'ms 1':>7} {'ms 1+pad':>8} {f'ms {w}':>7} {f'{w}/1':>6} "
          f"{'x fp32 1':>8} {f'x fp32 {w}':>8} {'top1':>5} {'max|dlogit|':>11}")
    for name, r in result.items():
        print(f"{name:26} {r['bytes'] / 1e6:6.1f} {r['ms_1']:7.2f} {r[f'ms_{PADDED}']:8.2f} "
              f"{r[f'ms_{w}']:7.2f} "
              f"{r['verify_over_decode']:6.2f} {r['decode_speedup_over_fp32']:8.2f} "
              f"{r['verify_speedup_over_fp32']:8.2f} {r['top1_agreement']:5.2f} "
              f"{r['max_abs_logit_diff']:11.3f}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"recipe": str(args.recipe), "weights": args.weights,
                                             "k": args.k, "rounds": args.rounds,
                                             "layouts": {n: (asdict(v) if isinstance(
                                                 v, NbitsLayout) else None) for n, v in
                                                 chosen(args.weights, names).items()},
                                             "results": result}, indent=1))


if __name__ == "__main__":
    main()

"""Proposers of different bundles side by side, in one process.

What it measures
----------------
`qpcbuild bench` measures the methods of ONE bundle against its own target-only. Two
proposers that live in different bundles (a draft model and an EAGLE-3 head for the same
target) are then compared across two bench runs, each against its own baseline, minutes
apart: on a shared machine whose speed drifts by 10% over a minute that comparison is mostly
noise. Here every configuration (each bundle's target-only and each bundle at each K) runs
over the same prompts in one process, interleaved, the order rotated every repeat, so the drift
spreads over all of them.

Reported per configuration: decode tokens/s (the tokens after the first, over decode time),
mean +- std over repeats; its speedup over the same bundle's target-only of the same repeat
(paired), mean +- std; mean acceptance length; milliseconds per target call and per proposer
call (a draft-model call or a head call). Exit 1 unless every run's greedy output equals its
bundle's target-only output token for token.

How to run (repository root, project venv active; bundles built by `qpcbuild compile`, their
Ks compiled):
    python benchmarks/proposers.py --bundle draft=build/smollm2 --bundle head=build/smollm2-eagle3 \\
        --ks 2,3 --prompt-set code --num-prompts 8 --max-new-tokens 96 --repeats 3
Results: a markdown table on stdout and benchmarks/results/proposers-<prompt set>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", action="append", required=True, metavar="NAME=PATH",
                    help="a bundle to compare (repeatable)")
    ap.add_argument("--ks", default="2,3", help="Ks to run on every bundle (compiled in each)")
    ap.add_argument("--prompt-set", default="code")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    bundles = {}
    for item in args.bundle:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_dir():
            ap.error(f"--bundle {item!r}: expected NAME=PATH to a bundle folder")
        bundles[name] = Path(path)
    try:
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        ap.error(f"--ks {args.ks!r}: expected a comma list of integers")
    return args, bundles, ks


def summary(runs: list[dict], bases: list[dict]) -> dict:
    rates = [r["decode_tokens_per_s"] for r in runs]
    ratios = [rate / b["decode_tokens_per_s"] for rate, b in zip(rates, bases)]
    last = runs[-1]

    def spread(xs):
        return {"mean": round(statistics.mean(xs), 3),
                "std": round(statistics.stdev(xs), 3) if len(xs) > 1 else 0.0}
    return {
        "decode_tokens_per_s": spread(rates), "speedup": spread(ratios),
        "decode_tokens_per_s_per_repeat": [round(x, 2) for x in rates],
        "mean_acceptance_length": round(1 + last["accepted"] / last["drafts"], 3)
        if last["drafts"] else None,
        "target_ms_per_call": round(1e3 * sum(r["target_s"] for r in runs)
                                    / sum(r["target_calls"] for r in runs), 2),
        "proposer_ms_per_call": round(1e3 * sum(r["draft_s"] for r in runs)
                                      / sum(r["draft_calls"] for r in runs), 3)
        if last["draft_calls"] else None,
    }


def main(argv=None) -> int:
    args, bundles, ks = parse_args(argv)
    import qpcbuild
    from qpcbuild.measuring import load_prompts
    from qpcbuild.tune.acceptance import summed_run  # greedy runs over prompts, stats summed

    gens = {name: qpcbuild.load(path) for name, path in bundles.items()}
    _, texts = load_prompts(None, args.prompt_set, args.num_prompts)
    configs = [(name, k) for name in gens for k in [0, *ks]]
    prompts = {name: [g.encode(t) for t in texts] for name, g in gens.items()}
    for name, k in configs:  # warm-up, not counted
        gens[name].generate([prompts[name][0]], 8, k=k, target_only=k == 0)
    runs: dict = {c: [] for c in configs}
    for rep in range(args.repeats):
        shift = rep % len(configs)
        for name, k in configs[shift:] + configs[:shift]:
            runs[(name, k)].append(summed_run(gens[name], prompts[name], args.max_new_tokens,
                                              k or None, target_only=k == 0))
            print(f"repeat {rep + 1}: {name} K={k} done", file=sys.stderr, flush=True)
    lossless = all(r["outputs"] == runs[(name, 0)][0]["outputs"]
                   for (name, _), rs in runs.items() for r in rs)
    rows = [{"bundle": name, "path": str(bundles[name]), "k": k,
             **summary(runs[(name, k)], runs[(name, 0)])} for name, k in configs]
    report = {"benchmark": "benchmarks/proposers.py", "prompt_set": args.prompt_set,
              "num_prompts": len(texts), "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "greedy_outputs_equal_target_only": lossless,
              "rows": rows}
    out = args.out or ROOT / "benchmarks" / "results" / f"proposers-{args.prompt_set}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("| bundle | K | decode tokens/s | speedup over its target-only | mean acceptance "
          "length | target ms/call (prefill included) | proposer ms/call |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bundle']} | {r['k']} | {r['decode_tokens_per_s']['mean']} +- "
              f"{r['decode_tokens_per_s']['std']} | {r['speedup']['mean']}x +- "
              f"{r['speedup']['std']} | {r['mean_acceptance_length'] or '-'} | "
              f"{r['target_ms_per_call']} | {r['proposer_ms_per_call'] or '-'} |")
    print(f"greedy outputs equal target-only: {lossless}; wrote {out}")
    return 0 if lossless else 1


if __name__ == "__main__":
    from qpcbuild.ort_threads import allow_shared_pool

    allow_shared_pool()  # the threads the qpcbuild command runs a bundle on (ort_threads.py)
    sys.exit(main())

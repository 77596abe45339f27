"""Aggregated against disaggregated serving of the same pair, on loopback: TTFT, TPOT and
throughput at 1, 4 and 16 concurrent clients with a mix of long and short prompts, and the KV
hand-off's cost per prompt length.

What it measures
----------------
The demo pair (recipes/demo.yaml, continuous batching with --slots KV slots) is built twice
into build/disagg-bench: aggregated, and disaggregated (the same recipe with a `disaggregated:`
block: the prefill unit in a worker process, the decode target and the draft in the server's).
Each is served by `qpcbuild serve` in a subprocess and loaded by benchmarks/serve.py's client
loop: C clients send streaming greedy completions back to back until --requests have finished,
alternating a short prompt (the start of a held-out prompt) and a long one (four held-out
prompts joined). Per level: generated tokens/s over the level's wall time, and the p50 / p99 of
time to first token and of time per output token after the first (TPOT), as the client sees
them. Then, on the disaggregated server, --handoff-requests requests of each length one at a
time, with the hand-off's bytes and seconds read from its /metrics.

Both servers and the clients share this machine's cores: see docs/disaggregated.md for what
such a run can and cannot show.

How to run (repository root, project venv active):
    python benchmarks/disagg_serve.py                 # a few minutes on 2 cores
Results: markdown tables on stdout and benchmarks/results/disagg_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve import QPCBUILD, level, prompts, served

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "disagg-bench"
# The decode node as in tests/test_disaggregated.py: target and draft share QID 1
DISAGGREGATED = {"prefill": {"device_group": [0], "num_cores": 16},
                 "decode": {"target": {"device_group": [1], "num_cores": 10},
                            "draft": {"device_group": [1], "num_cores": 6}}}


def build(slots: int) -> dict[str, Path]:
    """The aggregated and the disaggregated demo bundle, from one recipe with `slots` KV
    slots (one compile cache: the two share their exports)."""
    data = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    for role in ("target", "draft"):
        data[role]["model"] = str((ROOT / "recipes" / data[role]["model"]).resolve())
    data["shapes"]["full_batch_size"] = slots
    split = {**data, "hardware": {"card": data["hardware"]["card"]},
             "disaggregated": DISAGGREGATED}
    OUT.mkdir(parents=True, exist_ok=True)
    bundles = {}
    for name, recipe in (("aggregated", data), ("disaggregated", split)):
        path = OUT / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**recipe, "name": f"demo-{name}"}))
        subprocess.run(QPCBUILD + ["compile", str(path), "-o", str(OUT / name), "--cache-dir",
                                   str(OUT / "cache")], check=True, stdout=subprocess.DEVNULL)
        bundles[name] = OUT / name
    return bundles


def mixed_prompts() -> dict[str, str | list[str]]:
    held_out = prompts()
    short = [t[:len(t) // 5] for t in held_out]
    long = ["\n".join(held_out[i:i + 4]) for i in range(0, len(held_out) - 3, 4)]
    mix = [p for pair in zip(short, long) for p in pair]
    return {"mix": mix, "short": short, "long": long}


def handoff_totals(url: str) -> dict[str, float]:
    totals = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name in ("qpcbuild:kv_handoff_bytes_total", "qpcbuild:kv_handoff_seconds_sum",
                          "qpcbuild:kv_handoff_prefill_seconds_sum",
                          "qpcbuild:kv_handoff_requests_total"):
                totals[s.name.split(":")[1]] = s.value
    return totals


def handoff_per_length(url: str, model: str, texts: dict, n: int) -> list[dict]:
    rows = []
    for kind in ("short", "long"):
        before = handoff_totals(url)
        asyncio.run(level(url, model, 1, n, 1, texts[kind]))
        after = handoff_totals(url)
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        count = d["kv_handoff_requests_total"]
        rows.append({"prompts": kind, "requests": int(count),
                     "bytes_per_request": d["kv_handoff_bytes_total"] / count,
                     "handoff_ms": d["kv_handoff_seconds_sum"] / count * 1e3,
                     "worker_prefill_ms": d["kv_handoff_prefill_seconds_sum"] / count * 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=8, help="KV slots (full_batch_size)")
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--handoff-requests", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                    "disagg_serve.json")
    args = ap.parse_args(argv)
    bundles, texts = build(args.slots), mixed_prompts()
    report: dict = {"slots": args.slots, "max_tokens": args.max_tokens,
                    "requests_per_level": args.requests, "levels": [], "handoff": []}
    for layout, bundle in bundles.items():
        with served(bundle) as (url, model):
            asyncio.run(level(url, model, 1, 2, 8, texts["mix"]))  # warm-up
            for c in (int(x) for x in args.levels.split(",")):
                row = asyncio.run(level(url, model, c, args.requests, args.max_tokens,
                                        texts["mix"]))
                report["levels"].append({"layout": layout, **row})
                print(f"{layout}, {c} clients: {row['tokens_per_s']} tokens/s", file=sys.stderr)
            if layout == "disaggregated":
                report["handoff"] = handoff_per_length(url, model, texts,
                                                       args.handoff_requests)
    report["machine"] = {"cpus": os.cpu_count(), "loadavg_after": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("| clients | layout | tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |")
    print("|---|---|---|---|---|")
    for r in sorted(report["levels"], key=lambda r: (r["clients"], r["layout"])):
        tt, tp = r["ttft_ms"], r["tpot_ms"]
        print(f"| {r['clients']} | {r['layout']} | {r['tokens_per_s']:,} | {tt['p50']} / "
              f"{tt['p99']} | {tp['p50']} / {tp['p99']} |")
    print("\n| prompts | KV bytes per request | hand-off ms | worker prefill ms |")
    print("|---|---|---|---|")
    for h in report["handoff"]:
        print(f"| {h['prompts']} | {h['bytes_per_request']:,.0f} | {h['handoff_ms']:.2f} | "
              f"{h['worker_prefill_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

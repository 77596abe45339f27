"""Load benchmark of `qpcbuild serve` on loopback: throughput and latency at 1..16 clients.

What it measures
----------------
A bundle (default: the demo pair, recipes/demo.yaml with 8 KV slots for continuous batching,
built into build/serve-bench) is served by `qpcbuild serve` in a subprocess. For each
concurrency level C, C clients each send requests back to back (streaming completions, greedy,
--max-tokens new tokens, prompts from the demo pair's held-out set) until --requests requests have
finished. Per level: generated tokens/s over the wall time of the level, requests/s, and the
p50 / p90 / p99 of request latency and of time to first token (first streamed text), all seen
by the client. The server's own /metrics (vLLM names) are read after each level for the
acceptance rate.

How to run (repository root, project venv active):
    python benchmarks/serve.py                      # ~2 minutes on 2 cores
    python benchmarks/serve.py --levels 1,4 --requests 16 --bundle build/smollm2
Results: a markdown table on stdout and benchmarks/results/serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QPCBUILD = [sys.executable, "-m", "qpcbuild"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts() -> list[str]:
    lines = (ROOT / "models" / "demo" / "eval_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif ttft is None and event["choices"] and event["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
    latency = time.perf_counter() - t0
    # time per output token after the first (vLLM's TPOT), per request
    tpot = (latency - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return {"latency_s": latency, "ttft_s": ttft, "tpot_s": tpot, "tokens": tokens}


async def level(url: str, model: str, clients: int, total: int, max_tokens: int,
                texts: list[str] | None = None) -> dict:
    """`total` requests from `clients` concurrent clients, request n sending texts[n % len]
    (default: the demo pair's held-out prompts)."""
    texts = texts or prompts()
    queue = list(range(total))
    results: list[dict] = []

    async def client_loop(client):
        while queue:
            n = queue.pop()
            results.append(await one_request(client, url, model, texts[n % len(texts)],
                                             max_tokens))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    wall = time.perf_counter() - t0
    lat = np.array([r["latency_s"] for r in results])
    ttft = np.array([r["ttft_s"] for r in results if r["ttft_s"] is not None])
    tpot = np.array([r["tpot_s"] for r in results if r["tpot_s"] is not None])
    tokens = sum(r["tokens"] for r in results)

    def pct(a, q):
        return round(float(np.percentile(a, q)) * 1e3, 1) if len(a) else None

    return {"clients": clients, "requests": len(results), "tokens": tokens,
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "requests_per_s": round(len(results) / wall, 2),
            "latency_ms": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99)},
            "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "tpot_ms": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)}}


def acceptance(url: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == "vllm:spec_decode_draft_acceptance_rate":
                return round(s.value, 4)
    return None


@contextlib.contextmanager
def served(bundle: Path) -> Iterator[tuple[str, str]]:
    """`qpcbuild serve` on the bundle in a subprocess, on a free loopback port, until the block
    ends: (its URL, its model name) once /health answers."""
    model = json.loads((bundle / "manifest.json").read_text())["name"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(QPCBUILD + ["serve", str(bundle), "--port", str(port),
                                          "--log-level", "warning"])
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.2)
        yield url, model
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, default=None, help="serve this bundle instead")
    ap.add_argument("--slots", type=int, default=8, help="full_batch_size of the demo bundle")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve.json")
    args = ap.parse_args(argv)
    bundle = args.bundle
    if bundle is None:
        bundle = ROOT / "build" / "serve-bench"
        subprocess.run(QPCBUILD + ["compile", str(ROOT / "recipes" / "demo.yaml"), "-o",
                                   str(bundle), "--set", f"shapes.full_batch_size={args.slots}"],
                       check=True, stdout=subprocess.DEVNULL)
    with served(bundle) as (url, model):
        asyncio.run(level(url, model, 1, 2, 8))  # warm-up
        rows = []
        for c in (int(x) for x in args.levels.split(",")):
            row = asyncio.run(level(url, model, c, args.requests, args.max_tokens))
            row["acceptance_rate_so_far"] = acceptance(url)
            rows.append(row)
            print(f"{c} clients: {row['tokens_per_s']} tokens/s", file=sys.stderr)
    m = json.loads((bundle / "manifest.json").read_text())
    report = {"bundle": str(bundle.relative_to(ROOT) if bundle.is_relative_to(ROOT) else bundle),
              "method": m["speculation"]["method"], "shapes": m["shapes"],
              "max_tokens": args.max_tokens, "requests_per_level": args.requests,
              "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()}, "levels": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("| clients | tokens/s | requests/s | latency p50 / p90 / p99 ms | TTFT p50 / p90 / p99 ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        lat, tt = r["latency_ms"], r["ttft_ms"]
        print(f"| {r['clients']} | {r['tokens_per_s']:,} | {r['requests_per_s']} | "
              f"{lat['p50']} / {lat['p90']} / {lat['p99']} | {tt['p50']} / {tt['p90']} / "
              f"{tt['p99']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefill through tail windows against the full prefill window, on one bundle, in one process.

What it measures
----------------
A bundle built with ``shapes.prefill_tail_seq_lens`` (e.g. recipes/qwen-coder.yaml: 128 with
tails 32, 64, 96). For each prompt of the chosen sets, the prompt's prefill is timed for the
target and for the draft, once as the engine sends it (the last chunk through the narrowest tail
window that holds it) and once with the tails switched off (every chunk through
``prefill_seq_len``, as bundles without tails do), alternating, min over --repeats. Then
draft_model generation (K from --k, --max-new-tokens) alternates the two ways per prompt and
reports decode tokens/s for each, to show the tail windows leave the decode steps alone.

Checks (exit 1 when one fails): the first token's logits agree between the two ways
(max |diff| < 1e-3) and the generated tokens are equal.

How to run (repository root, project venv active):

    qpcbuild compile recipes/qwen-coder.yaml -o build/qwen-coder
    python benchmarks/prefill_windows.py build/qwen-coder --sets code,prose
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import qpcbuild
from qpcbuild.measuring import load_prompts
from qpcbuild.runtime.rows import LoopTimes, new_row
from qpcbuild.runtime.sampling import SamplingParams


def prefill_seconds(dec, session, ids: list[int], role: str) -> tuple[float, np.ndarray]:
    row = new_row(ids, 1, dec.ctx_len, SamplingParams(), 0)
    t0 = time.perf_counter()
    logits = dec._prefill(session, [row], LoopTimes(), role)
    return time.perf_counter() - t0, logits[0].copy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--sets", default="code,prose")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    gen = qpcbuild.load(a.bundle, method="draft_model", k=a.k, verify="none")
    dec = gen.decoder
    tails = dec.prefill_tails
    if not tails:
        print(f"{a.bundle} has no prefill tail windows (shapes.prefill_tail_seq_lens)")
        return 1
    ways = {"full": (), "tails": tails}
    print(f"prefill_seq_len {dec.prefill_len}, tail windows {list(tails)}")
    failed = False
    decode = {w: [0.0, 0] for w in ways}
    for name in a.sets.split(","):
        _, prompts = load_prompts(None, name, a.num_prompts)
        for n, text in enumerate(prompts):
            ids = gen.encode(text)
            best: dict[tuple[str, str], float] = {}
            first: dict[str, np.ndarray] = {}
            for rep in range(a.repeats):
                for way in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
                    dec.prefill_tails = ways[way]
                    for role, session in (("target", dec.target), ("draft", dec.draft)):
                        s, logits = prefill_seconds(dec, session, ids, role)
                        best[way, role] = min(best.get((way, role), s), s)
                        if role == "target":
                            first[way] = logits
            diff = float(np.abs(first["full"] - first["tails"]).max())
            full = best["full", "target"] + best["full", "draft"]
            narrow = best["tails", "target"] + best["tails", "draft"]
            print(f"{name} prompt {n}: {len(ids):4d} tokens  target {best['full', 'target'] * 1e3:6.0f}"
                  f" -> {best['tails', 'target'] * 1e3:6.0f} ms  draft {best['full', 'draft'] * 1e3:5.0f}"
                  f" -> {best['tails', 'draft'] * 1e3:5.0f} ms  both {full / narrow:.2f}x  "
                  f"first-token logits max |diff| {diff:.1e}")
            failed |= diff >= 1e-3
            outputs = {}
            for way in (list(ways) if n % 2 == 0 else list(ways)[::-1]):
                dec.prefill_tails = ways[way]
                rows, times = dec.generate([ids], a.max_new_tokens, SamplingParams())
                outputs[way] = rows[0].tokens
                decode[way][0] += times.total_s - times.prefill_s
                decode[way][1] += len(rows[0].tokens) - len(ids) - 1
            if outputs["full"] != outputs["tails"]:
                print(f"  generated tokens differ on {name} prompt {n}")
                failed = True
    for way, (seconds, tokens) in decode.items():
        print(f"decode with {way:5s} prefill: {tokens / seconds:.2f} tokens/s "
              f"({tokens} tokens, K={a.k})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Hand-off cost per prompt length, and time to first token, of SmolLM2 disaggregated
(recipes/smollm2-disagg.yaml) against aggregated (recipes/smollm2.yaml), on ONNX Runtime.

    python benchmarks/disagg_handoff.py AGGREGATED_BUNDLE DISAGGREGATED_BUNDLE

For each prompt length, each bundle prefills the same tokens three times and decodes 4 tokens.
Greedy outputs must be equal. The script prints the medians as a markdown table: the KV bytes
that crossed between the processes, the seconds the crossing added, the worker's prefill
seconds and each bundle's TTFT. Both bundles run in this process and the prefill worker's, so
on a small machine the two processes share the same cores: this shows the cost of the hand-off,
not a disaggregated speed-up.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from qpcbuild.runtime.loader import load

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (16, 64, 256, 512)
REPEATS = 3


def main(aggregated: str, disaggregated: str) -> None:
    agg, dis = load(aggregated), load(disaggregated)
    prompts = ROOT / "qpcbuild" / "data" / "prompts"
    text = (prompts / "prose.jsonl").read_text() + (prompts / "code.jsonl").read_text()
    source = dis.encode(text * 3)
    assert len(source) >= max(LENGTHS), len(source)
    print("| prompt tokens | hand-off bytes | hand-off ms | worker prefill ms "
          "| TTFT aggregated ms | TTFT disaggregated ms |")
    print("|---|---|---|---|---|---|")
    for n in LENGTHS:
        ids = source[:n]
        ttft_agg, ttft_dis, crossing, prefill = [], [], [], []
        nbytes = 0
        for _ in range(REPEATS):
            a = agg.generate([ids], max_new_tokens=4).rows[0]
            d = dis.generate([ids], max_new_tokens=4)
            assert d.handoff is not None and a.tokens == d.rows[0].tokens
            ttft_agg.append(a.stats.ttft_s)
            ttft_dis.append(d.rows[0].stats.ttft_s)
            record = d.handoff["per_prompt"][0]
            crossing.append(record["seconds"])
            prefill.append(record["prefill_s"])
            nbytes = record["bytes"]
        med = statistics.median
        print(f"| {n} | {nbytes:,} | {med(crossing) * 1e3:.2f} | {med(prefill) * 1e3:.1f} "
              f"| {med(ttft_agg) * 1e3:.1f} | {med(ttft_dis) * 1e3:.1f} |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

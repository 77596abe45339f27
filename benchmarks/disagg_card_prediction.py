"""The card's prediction for a disaggregated recipe, from the roofline cost model: the KV
hand-off's bytes per prompt length, their time over a link of the speed you give, and how long
the decode node's slots wait when a prompt is admitted, aggregated against disaggregated.

    python benchmarks/disagg_card_prediction.py recipes/llama8b-1b-disagg.yaml --link-gbps 100

--link-gbps is required and is printed as an assumption: no measured or published figure for
the path between the prefill and the decode QIDs is recorded here. Nothing is measured; the
model's assumptions are printed with the table (--json: everything as JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qpcbuild.errors import QpcbuildError
from qpcbuild.recipe import load_recipe
from qpcbuild.tune.costs import roofline_figures
from qpcbuild.tune.disagg_prediction import ASSUMPTIONS, admission_costs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--link-gbps", type=float, required=True,
                    help="the prefill-to-decode link's speed in Gbit/s (an assumption)")
    ap.add_argument("--lengths", default="128,512,2000", help="prompt lengths in tokens")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        r = load_recipe(args.recipe)
        lengths = [int(x) for x in args.lengths.split(",")]
        fig = roofline_figures(r)
        costs = admission_costs(r, lengths, args.link_gbps, fig)
    except (QpcbuildError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assumed = f"ASSUMED link speed: {args.link_gbps:g} Gbit/s (given, not measured)"
    if args.json:
        print(json.dumps({"recipe": r.name, "link_gbps_assumed": args.link_gbps,
                          "figures": fig, "assumptions": ASSUMPTIONS,
                          "per_prompt": [c.to_dict() for c in costs]}, indent=1))
        return 0
    print(f"{r.name} on {fig['card']} ({fig['dram_gbs_per_qid']:g} GB/s, "
          f"{fig['fp16_tflops_per_qid']:g} fp16 TFLOPS per QID: {fig['source']})")
    print(assumed)
    print(f"KV precision {r.precision.kv_cache_dtype}; one decode step of the decode node's "
          f"slots: {costs[0].decode_step_s * 1e3:.2f} ms (roofline)\n")
    print("| prompt tokens | hand-off MB | link ms (assumed speed) | prefill node ms "
          "| decode slots wait, aggregated ms | decode slots wait, disaggregated ms |")
    print("|---|---|---|---|---|---|")
    for c in costs:
        print(f"| {c.prompt_tokens} | {c.handoff_bytes / 1e6:.1f} | {c.link_s * 1e3:.2f} | "
              f"{c.prefill_s * 1e3:.1f} | {c.decode_wait_aggregated_s * 1e3:.1f} | "
              f"{c.decode_wait_disaggregated_s * 1e3:.1f} |")
    print("\nAssumptions:")
    for a in ASSUMPTIONS:
        print(f"- {a}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The goodput gate alone (qpcbuild/runtime/gate.py), on simulated sampled decoding: how much of
fixed K's gain `policy: auto` keeps where speculation pays, and how close to plain decoding it
stays where speculation loses.

A speculative step proposes K tokens; each is accepted with probability `a` until the first
rejection (tokens per step: 1 plus the accepted prefix, 1 to K+1, as under speculative
sampling); it costs `spec_ms`, a plain step 1 token for `plain_ms`. One gate serves a stream of
short requests (a new row each, as the engine keeps its gates across calls). No model runs: the
only thing measured is the gate's choices, so the numbers are exact for the simulated costs and
say nothing about noise in real step times.

--shadowed: a model-free proposer (ngram, suffix). While speculation is off, the gate's shadow
proposals (K tokens, costing --propose-ms) are matched against the plain steps' tokens, each
plain token equal to the shadow's next one with probability `a` (what speculative sampling
would have accepted).

Usage: python benchmarks/gate_simulation.py [--shadowed] [--json-out FILE]
(PYTHONPATH=CHECKOUT python benchmarks/gate_simulation.py measures another checkout's gate.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics

from qpcbuild.runtime.gate import DEFAULT, GoodputConfig, Goodput
from qpcbuild.runtime.rows import RowRate


def run(a: float, k: int, spec_ms: float, plain_ms: float, requests: int, tokens: int,
        seed: int, shadowed: bool = False, propose_ms: float = 0.0, request_spread: float = 0.0,
        catch_up_ms: float = 0.0, noise: float = 0.0, config: GoodputConfig = DEFAULT) -> dict:
    rng = random.Random(seed)
    gate = Goodput(shadowed=shadowed, config=config)
    made, seconds, spec_steps, steps = 0, 0.0, 0, 0
    for _ in range(requests):
        row, got, behind = RowRate(), 0, 0
        # this request's acceptance: requests differ (their texts do) around the stream's mean
        a_row = min(max(a + rng.uniform(-request_spread, request_spread), 0.0), 0.99)
        while got < tokens:
            mode = gate.choose([row])
            n, step_s = 1, (spec_ms if mode == "spec" else plain_ms) / 1e3
            if noise:  # a busy machine: step times spread around their cost
                step_s *= rng.lognormvariate(-noise * noise / 2, noise)  # mean 1
            caught_up = 0.0
            if mode == "spec":
                # a draft model reads the tokens decoded without it before it proposes
                caught_up, behind = behind * catch_up_ms / 1e3, 0
                while n <= k and rng.random() < a_row:
                    n += 1
            elif not shadowed:
                behind += 1
            elif gate.shadow_due(row):
                row.shadow = [0] * k  # a shadow token is 0; a plain token matches it with p=a
                gate.shadow_cost(propose_ms / 1e3, 1)
                step_s += propose_ms / 1e3
            gate.record(mode, step_s, [(row, n)])
            if shadowed and mode == "plain":
                gate.observe_plain(row, 0 if rng.random() < a_row else 1, 1)
            elif shadowed:
                gate.drop_shadow(row)
            got, seconds, steps = got + n, seconds + step_s + caught_up, steps + 1
            spec_steps += mode == "spec"
        made += got
    return {"x_plain": made / seconds * plain_ms / 1e3, "spec_share": spec_steps / steps,
            "switches": len(gate.switches)}


def parse_config(settings: list[str]) -> GoodputConfig:
    """The gate's default config with NAME=VALUE changes (the field's own type)."""
    changes = {}
    for item in settings:
        name, _, value = item.partition("=")
        if not hasattr(DEFAULT, name) or not value:
            raise SystemExit(f"--set {item}: not NAME=VALUE of a GoodputConfig field "
                             f"({', '.join(DEFAULT.__dataclass_fields__)})")
        changes[name] = type(getattr(DEFAULT, name))(float(value))
    return dataclasses.replace(DEFAULT, **changes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--spec-ms", type=float, default=10.0)
    ap.add_argument("--plain-ms", type=float, default=5.0)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--shadowed", action="store_true", help="a model-free proposer's gate")
    ap.add_argument("--propose-ms", type=float, default=0.05,
                    help="one shadow proposal's cost (with --shadowed)")
    ap.add_argument("--acceptance", default="0.4,0.45,0.5,0.55,0.6,0.65,0.7,0.8",
                    help="comma list of per-token acceptance rates to simulate")
    ap.add_argument("--request-spread", type=float, default=0.0,
                    help="each request's acceptance is drawn from a +- this around a")
    ap.add_argument("--catch-up-ms", type=float, default=0.0,
                    help="a draft model's cost per token decoded without it, paid when it "
                         "next proposes")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="log-normal spread of step times (0: every step costs its mean)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a GoodputConfig field for this run (repeatable), e.g. evidence_z=0 "
                         "to measure the gate without that rule")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    config = parse_config(args.set)
    rows = []
    print("| acceptance a | tokens per step | fixed K (x plain) | auto (x plain) | auto, worst seed "
          "| auto / fixed | steps speculating |")
    print("|---|---|---|---|---|---|---|")
    for a in (float(x) for x in args.acceptance.split(",")):
        mean_tokens = sum(a ** j for j in range(args.k + 1))
        fixed = mean_tokens / args.spec_ms * args.plain_ms
        runs = [run(a, args.k, args.spec_ms, args.plain_ms, args.requests, args.tokens, seed,
                    args.shadowed, args.propose_ms, args.request_spread, args.catch_up_ms,
                    args.noise, config) for seed in range(args.seeds)]
        auto = statistics.mean(r["x_plain"] for r in runs)
        rows.append({"a": a, "tokens_per_step": mean_tokens, "fixed_x_plain": fixed,
                     "auto_x_plain": auto, "auto_worst": min(r["x_plain"] for r in runs),
                     "spec_share": statistics.mean(r["spec_share"] for r in runs),
                     "runs": runs})
        print(f"| {a} | {mean_tokens:.2f} | {fixed:.3f} | {auto:.3f} | {rows[-1]['auto_worst']:.3f}"
              f" | {auto / fixed:.3f} | {rows[-1]['spec_share']:.2f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

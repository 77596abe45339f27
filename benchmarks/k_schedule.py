"""K for the live batch under continuous batching: a K schedule against every fixed K.

What it measures
----------------
The demo pair (recipes/demo.yaml, draft_model; --recipe for another pair or method) built
with continuous batching (``shapes.full_batch_size``, default 8) and every K in 0..--k-max,
into build/k-schedule-bench.
The K schedule (live batch size -> K) comes from ``qpcbuild tune --per-batch`` on that recipe
(its ``per_batch`` record), or from --schedule, or, with --bundle and no --schedule, from the
bundle's manifest (``speculation.num_speculative_tokens_per_batch_size``).

For each number of concurrent requests C (--concurrency, default 1,2,4,8), C requests are handed
to the engine at once, in-process, as the server's worker does (``SpecDecoder.run_rows``):
prompts from the demo pair's held-out set (``models/demo/eval_prompts.jsonl``, the first
--prompt-tokens tokens of each), greedy, with mixed lengths (request i of C may make
--max-new-tokens x (i+1)/C new tokens), so rows end at different steps and the number of live
rows falls from C to 1 during a run. Each C runs once with the schedule (K chosen per step for
the live rows) and once per fixed K (policy fixed, no goodput gate), the configurations
interleaved and rotated across --repeats so the machine's drift spreads over all of them.

Checks (exit 1 when one fails): every run's output equals the first run's token for token
(greedy speculative decoding is lossless), and every verify step's K (the engine's
``LoopTimes.step_ks``, steps by live rows and K) is the schedule's K for its live rows, or the
fixed K.

Reported per C and configuration: generated tokens/s over the run's wall time (prefill
included), mean +- std over repeats; the schedule's ratio to the best fixed K (the best by mean
tokens/s), as the ratio of means and as the mean +- std of the per-repeat ratios (paired: same
repeat, adjacent in time); and the steps per (live rows, K).

How to run (repository root, project venv active):
    python benchmarks/k_schedule.py                       # tune, build, measure: ~10 minutes
    python benchmarks/k_schedule.py --schedule 1:4,2:3,4:2,8:1
    python benchmarks/k_schedule.py --bundle build/k-schedule-bench --concurrency 1,2 \\
        --max-new-tokens 8 --repeats 1
Results: a markdown table on stdout and benchmarks/results/k_schedule.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QPCBUILD = [sys.executable, "-m", "qpcbuild"]
EVAL_PROMPTS = ROOT / "models" / "demo" / "eval_prompts.jsonl"  # held out from the demo's training

from qpcbuild.errors import QpcbuildError, UsageError  # noqa: E402  (after its sys.path entry)
from qpcbuild.runtime.policy import KSchedule  # noqa: E402  (after its sys.path entry)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_schedule(text: str) -> dict[int, int]:
    """"1:4,2:3,4:2,8:1" -> {1: 4, 2: 3, 4: 2, 8: 1}."""
    schedule = {}
    for item in text.split(","):
        size, sep, k = item.strip().partition(":")
        if not (sep and size.strip().isdigit() and k.strip().isdigit()) or int(size) < 1:
            raise UsageError(f"--schedule: '{item.strip()}' is not BATCH_SIZE:K with a batch "
                             "size >= 1 and K >= 0 (example: 1:4,2:3,4:2,8:1)")
        schedule[int(size)] = int(k)
    return dict(sorted(schedule.items()))


def check_schedule(schedule: dict[int, int], ks: tuple[int, ...], where: str) -> None:
    """Every K the schedule names must be compiled in the bundle."""
    for size, k in schedule.items():
        if k not in ks:
            raise UsageError(f"K schedule {size}:{k}: K={k} is not compiled in {where} "
                             f"(compiled Ks: {list(ks)})")
    if not schedule:
        raise UsageError(f"no K schedule: {where} records none; pass --schedule")


def scheduled_k(schedule: dict[int, int], live: int, k_max: int) -> int:
    """The documented rule (docs/adaptive.md): the K of the largest scheduled batch size not
    above the live rows; fewer rows than the smallest size: the largest compiled K."""
    sizes = [b for b in schedule if b <= live]
    return schedule[max(sizes)] if sizes else k_max


def tuned_schedule(recipe: Path, k_max: int, slots: int, sizes: list[int], rounds: int
                   ) -> tuple[dict[int, int], dict]:
    """`qpcbuild tune --per-batch` on the CB recipe: its best K per batch size, and the
    command and its per_batch record."""
    # Acceptance from the texts the runs below decode (the first prompts of the held-out set,
    # as many as the largest C takes), not from tune's default prompt set.
    cmd = QPCBUILD + ["tune", str(recipe), "--set",
                      f"shapes.full_batch_size={slots}", "--per-batch",
                      ",".join(map(str, sizes)), "--k-max", str(k_max),
                      "--prompts", str(EVAL_PROMPTS), "--num-prompts", str(max(sizes)),
                      "--max-new-tokens", "48", "--rounds", str(rounds), "--json"]
    say("tune: " + " ".join(cmd[len(QPCBUILD):]))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    per_batch = json.loads(out)["per_batch"]
    return ({p["batch_size"]: p["chosen_k"] for p in per_batch},
            {"command": "qpcbuild " + " ".join(cmd[len(QPCBUILD):]), "per_batch": per_batch})


def build_bundle(recipe: Path, out: Path, k_max: int, slots: int,
                 schedule: dict[int, int]) -> None:
    flow = "{" + ", ".join(f"{b}: {k}" for b, k in schedule.items()) + "}"
    cmd = QPCBUILD + ["compile", str(recipe), "-o", str(out),
                      "--set", f"shapes.full_batch_size={slots}",
                      "--set", f"speculation.num_speculative_tokens={list(range(k_max + 1))}",
                      "--set", f"speculation.num_speculative_tokens_per_batch_size={flow}"]
    say("build: " + " ".join(cmd[len(QPCBUILD):]))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def prompt_ids(gen, n_tokens: int) -> list[list[int]]:
    lines = EVAL_PROMPTS.read_text().splitlines()
    return [gen.encode(json.loads(line)["text"])[:n_tokens] for line in lines]


def run_once(gen, prompts: list[list[int]], c: int, max_new: int, k: int | None) -> dict:
    """C requests at once, request i allowed max_new * (i+1) / C new tokens; k None: the
    decoder's K schedule per step."""
    from qpcbuild.runtime.engine import new_row
    from qpcbuild.runtime.sampling import SamplingParams

    dec = gen.decoder
    rows = [new_row(prompts[i % len(prompts)], max(1, round(max_new * (i + 1) / c)),
                    dec.ctx_len, SamplingParams(), i) for i in range(c)]
    times = dec.run_rows(rows, k=k, policy="fixed")
    new = sum(len(r.tokens) - len(r.prompt) for r in rows)
    return {"tokens_per_s": new / times.total_s, "new_tokens": new, "seconds": times.total_s,
            "outputs": [r.tokens[len(r.prompt):] for r in rows], "step_ks": times.step_ks}


def wrong_steps(step_ks: dict, schedule: dict[int, int], k: int | None, k_max: int) -> list:
    """Steps whose K is not what the configuration asks for its live rows."""
    return [(live, got) for live, got in step_ks
            if got != (k if k is not None else scheduled_k(schedule, live, k_max))]


def measure(gen, schedule: dict[int, int], args) -> tuple[list[dict], list[str]]:
    """Every (repeat, C, configuration) run, configurations rotated per repeat; and the
    problems found (outputs differing, steps at the wrong K)."""
    ks = gen.decoder.ks
    configs: list[int | None] = [None] + list(ks)
    prompts = prompt_ids(gen, args.prompt_tokens)
    runs, problems, reference = [], [], {}
    run_once(gen, prompts, 1, 4, None)  # warm-up: the sessions' first calls
    for rep in range(args.repeats):
        for c in args.concurrency:
            shift = (rep + c) % len(configs)
            for k in configs[shift:] + configs[:shift]:
                name = "schedule" if k is None else f"K={k}"
                r = run_once(gen, prompts, c, args.max_new_tokens, k)
                ref = reference.setdefault(c, (name, r["outputs"]))
                if r["outputs"] != ref[1]:
                    problems.append(f"C={c}: {name} output differs from {ref[0]}'s (repeat {rep})")
                bad = wrong_steps(r["step_ks"], schedule, k, max(ks))
                if bad:
                    problems.append(f"C={c}: {name} ran steps at the wrong K (live rows, K): "
                                    f"{bad}")
                runs.append({"repeat": rep, "concurrency": c, "config": name,
                             "tokens_per_s": round(r["tokens_per_s"], 2),
                             "new_tokens": r["new_tokens"], "seconds": round(r["seconds"], 4),
                             "steps_by_live_rows_and_k": {f"{live}:{kk}": n for (live, kk), n
                                                          in sorted(r["step_ks"].items())}})
                say(f"repeat {rep} C={c} {name}: {r['tokens_per_s']:.1f} tokens/s")
    return runs, problems


def summarize(runs: list[dict], concurrency: list[int]) -> list[dict]:
    """Per C and configuration: tokens/s mean and std; per C the schedule against the best
    fixed K."""
    out = []
    for c in concurrency:
        at_c = [r for r in runs if r["concurrency"] == c]
        names = sorted({r["config"] for r in at_c}, key=lambda n: (n != "schedule", n))
        by = {n: np.array([r["tokens_per_s"] for r in at_c if r["config"] == n]) for n in names}
        best = max((n for n in names if n != "schedule"), key=lambda n: by[n].mean())
        paired = by["schedule"] / by[best]
        for n in names:
            steps = next(r["steps_by_live_rows_and_k"] for r in at_c if r["config"] == n)
            out.append({"concurrency": c, "config": n, "tokens_per_s_mean":
                        round(float(by[n].mean()), 2), "tokens_per_s_std":
                        round(float(by[n].std()), 2), "steps_by_live_rows_and_k": steps,
                        "best_fixed_k": best if n == "schedule" else None,
                        "ratio_to_best_fixed_k": round(float(by[n].mean() / by[best].mean()), 3),
                        "paired_ratio_mean": round(float(paired.mean()), 3)
                        if n == "schedule" else None,
                        "paired_ratio_std": round(float(paired.std()), 3)
                        if n == "schedule" else None})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| C | configuration | tokens/s | x best fixed K | steps (live rows:K = steps) |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio_to_best_fixed_k']:.3f}"
        if r["config"] == "schedule":
            ratio += (f" (paired {r['paired_ratio_mean']:.3f} ± {r['paired_ratio_std']:.3f};"
                      f" best: {r['best_fixed_k']})")
        steps = ", ".join(f"{key}={n}" for key, n in r["steps_by_live_rows_and_k"].items())
        lines.append(f"| {r['concurrency']} | {r['config']} | {r['tokens_per_s_mean']:.1f} ± "
                     f"{r['tokens_per_s_std']:.1f} | {ratio} | {steps} |")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "demo.yaml",
                    help="the recipe to tune and build (its method is measured)")
    ap.add_argument("--bundle", type=Path, default=None, help="measure this CB bundle instead")
    ap.add_argument("--schedule", default=None, help="BATCH_SIZE:K,... (default: tune's)")
    ap.add_argument("--slots", type=int, default=8, help="full_batch_size of the built bundle")
    ap.add_argument("--k-max", type=int, default=4, help="the built bundle compiles K=0..K_MAX")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="tokens kept of each prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tune-rounds", type=int, default=20,
                    help="tune's timed calls per K and batch size (its --rounds)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                    "k_schedule.json")
    args = ap.parse_args(argv)
    try:
        args.concurrency = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency: '{args.concurrency}' is not a comma-separated list of counts")
    if min(args.concurrency) < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--concurrency, --repeats and --max-new-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import qpcbuild

    try:
        schedule = parse_schedule(args.schedule) if args.schedule else None
        tuned = None
        bundle = args.bundle
        if bundle is None:
            if schedule is None:
                schedule, tuned = tuned_schedule(args.recipe, args.k_max, args.slots,
                                                 [1, 2, 4, 8], args.tune_rounds)
            check_schedule(schedule, tuple(range(args.k_max + 1)), "the bundle to build")
            bundle = ROOT / "build" / "k-schedule-bench"
            build_bundle(args.recipe, bundle, args.k_max, args.slots, schedule)
        gen = qpcbuild.load(bundle)  # the method it was built for
        slots = gen.manifest.shapes.full_batch_size
        if not slots:
            raise UsageError(f"{bundle}: not built for continuous batching "
                             "(shapes.full_batch_size); rebuild with --set "
                             "shapes.full_batch_size=8")
        if schedule is None:
            schedule = gen.manifest.speculation.schedule
        check_schedule(schedule, gen.decoder.ks, str(bundle))
        if max(args.concurrency) > slots:
            raise UsageError(f"--concurrency {max(args.concurrency)} exceeds the bundle's "
                             f"{slots} KV slots")
    except QpcbuildError as exc:
        say(f"error: {exc}")
        return 2
    gen.decoder.k_schedule = KSchedule(schedule)  # measured: the manifest's or --schedule
    load_start = os.getloadavg()
    t0 = time.time()
    runs, problems = measure(gen, schedule, args)
    rows = summarize(runs, args.concurrency)
    report = {"bundle": str(bundle.relative_to(ROOT) if bundle.is_relative_to(ROOT) else bundle),
              "schedule": {str(b): k for b, k in schedule.items()},
              "schedule_source": "--schedule" if args.schedule else
              "tune --per-batch" if tuned else "bundle manifest",
              "tune": tuned, "compiled_ks": list(gen.decoder.ks),
              "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
              "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
              "loadavg_at_start": [round(x, 2) for x in load_start],
              "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
              "cpus": os.cpu_count(), "wall_s": round(time.time() - t0, 1),
              "problems": problems, "summary": rows, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"K schedule {report['schedule']} ({report['schedule_source']}), compiled Ks "
          f"{report['compiled_ks']}, load average {report['loadavg_at_start'][0]} -> "
          f"{report['loadavg_at_end'][0]} on {report['cpus']} CPUs\n")
    print(table(rows))
    for p in problems:
        say("PROBLEM: " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

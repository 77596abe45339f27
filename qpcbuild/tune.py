"""`qpcbuild tune`: pick K from measured evidence instead of a guess.

1. Build a calibration bundle from the recipe with every K in 0..K_max (exports come from the
   build cache; nothing is exported twice).
2. Run the recipe's method at K_max on calibration prompts (ONNX Runtime, greedy) and read the
   per-position acceptance: alpha_1 = accepted[0] / drafts, alpha_j = accepted[j-1] /
   accepted[j-2] (the probability that position j is accepted given that j-1 was).
3. Time the pieces directly through the sessions: one draft step (seq_len 1) and, for each K,
   one target verify of K+1 tokens at a realistic position (lower quartile of many calls, all
   Ks interleaved so that machine drift hits them alike; see `lower_quartile`). Host overhead per model call (or per step
   for the model-free methods) comes from the calibration run.
4. For each K: expected tokens per step E(K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j over the cost
   of a step, and pick the K with the most tokens per second.

   draft_model:  cost(K) = D(K) (1 + c(K) / K) + t_verify(K) + h(K), where D(K) is K draft
                 steps timed in a row (as the loop runs them) and c(K) = prod_{j<=K} alpha_j: a
                 step that accepts all K drafts leaves the draft one token behind, which costs
                 one catch-up draft call in the next step.
   ngram/suffix: tokens(K) = p E(K) + (1 - p), cost(K) = p t_verify(K) + (1 - p) t_verify(0)
                 + h(K), where p is the fraction of steps that had a proposal (the compile list
                 [0, K] runs proposals of any length in the K+1 window, the others at K=0).
   h(K), the loop's own time per step, is measured at K=1 and K=K_max and interpolated.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .errors import Problem, RecipeError, UsageError

Say = Callable[[str], None]
DEFAULT_K_MAX = 8
TUNE_MARK = "# tune:"


# ---------------------------------------------------------------- the model (pure functions)
def conditional_acceptance(accepted_per_pos: list[int], num_drafts: int) -> list[float]:
    """alpha_j, j = 1..len: P(position j accepted | position j-1 accepted)."""
    alphas, prev = [], num_drafts
    for a in accepted_per_pos:
        alphas.append(a / prev if prev else 0.0)
        prev = a
    return alphas


def expected_tokens(alphas: list[float], k: int) -> float:
    """Expected tokens per verify step with K proposed tokens: 1 + sum_{i<=K} prod_{j<=i}
    alpha_j (the target's own token always counts; positions beyond the evidence count 0)."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= alphas[i] if i < len(alphas) else 0.0
        total += run
    return total


def all_accepted(alphas: list[float], k: int) -> float:
    """prod_{j<=K} alpha_j: the probability that a step accepts all K proposals."""
    return math.prod(alphas[i] if i < len(alphas) else 0.0 for i in range(k))


def host_model(points: dict[int, float]) -> Callable[[int], float]:
    """Host (Python) seconds per step as a function of K: linear through the measured points
    (one point: constant)."""
    ks = sorted(points)
    if len(ks) == 1:
        return lambda k: points[ks[0]]
    (k0, h0), (k1, h1) = (ks[0], points[ks[0]]), (ks[-1], points[ks[-1]])
    slope = (h1 - h0) / (k1 - k0)
    return lambda k: max(0.0, h0 + slope * (k - k0))


def predict(method: str, alphas: list[float] | dict[int, list[float]],
            t_draft: float | dict[int, float] | None, t_verify: dict[int, float],
            host_per_step: Callable[[int], float] | float, p_proposal: float | dict[int, float],
            ks: list[int], host_target_only: float | None = None) -> list[dict[str, Any]]:
    """Expected tokens, cost (seconds) and tokens/s per K. alphas (and p_proposal) may be one
    list for every K or one per K; t_verify must hold 0 (or the smallest compiled K) and every
    K in ks; t_draft is the seconds of one draft step, or per K the seconds of K draft steps in
    a row; host_per_step(K) is the loop's own time per step."""
    host_of = host_per_step if callable(host_per_step) else (lambda k: host_per_step)
    base_k = min(t_verify)
    base_rate = 1.0 / (t_verify[base_k] + (host_target_only if host_target_only is not None
                                           else host_of(0)))
    rows = []
    for k in ks:
        a = alphas[k] if isinstance(alphas, dict) else alphas
        p = p_proposal[k] if isinstance(p_proposal, dict) else p_proposal
        e = expected_tokens(a, k)
        host = host_of(k)
        if method == "draft_model":
            c = all_accepted(a, k)
            if isinstance(t_draft, dict):  # K steps measured together, plus the catch-up call
                draft = t_draft[k] * (1 + c / k)
            else:
                draft = (k + c) * (t_draft or 0.0)
            verify = t_verify[k]
            tokens = e
        else:
            draft = 0.0
            verify = p * t_verify[k] + (1 - p) * t_verify[base_k]
            tokens = p * e + (1 - p)
        cost = draft + verify + host
        rate = tokens / cost if cost > 0 else 0.0
        rows.append({"k": k, "expected_tokens_per_step": round(tokens, 4),
                     "expected_accepted_len": round(e, 4),
                     "alpha": [round(x, 4) for x in a[:k]],
                     "draft_ms": round(draft * 1e3, 4), "verify_ms": round(verify * 1e3, 4),
                     "host_ms": round(host * 1e3, 4), "cost_ms": round(cost * 1e3, 4),
                     "tokens_per_s": round(rate, 2),
                     "predicted_speedup": round(rate / base_rate, 3)})
    best = max((r["tokens_per_s"] for r in rows), default=0.0)
    for r in rows:
        r["vs_best"] = round(r["tokens_per_s"] / best - 1, 4) if best else None
    return rows


def choose_k(rows: list[dict[str, Any]]) -> int:
    """The K with the most expected tokens per second (ties: the smaller K)."""
    if not rows:
        raise UsageError("no candidate K to choose from")
    return max(rows, key=lambda r: (r["tokens_per_s"], -r["k"]))["k"]


def recommended_ks(method: str, k: int) -> list[int]:
    """What to compile: draft_model [K]; ngram/suffix [0, K] (K=0 serves steps without a
    proposal) - exactly what `num_speculative_tokens: K` resolves to."""
    return [k] if method == "draft_model" else sorted({0, k})


# ---------------------------------------------------------------- replaying the loop
def _new_stats(k: int) -> dict[str, Any]:
    return {"k": k, "steps": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0,
            "per_pos": [0] * k, "catch_up": 0, "tokens": 0}


def replay_draft(matches: list[bool], n_out: int, max_new: int, k: int,
                 acc: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine's draft_model steps for one request whose greedy output has n_out tokens, at
    speculative length K. matches[i]: the draft's greedy next token after the prompt and output
    tokens 0..i equals output token i+1 (one teacher-forced draft pass gives them all). A step
    proposes min(K, tokens left - 1) tokens, accepts the run of matches from its start, and adds
    the target's own token; a step that accepts all its drafts costs a catch-up draft call in
    the next one. Greedy acceptance depends only on the output, so this is exact for any K."""
    st = acc if acc is not None else _new_stats(k)
    done, full = 1, False  # output token 0 comes from the prefill
    st["tokens"] += max(0, n_out - 1)
    while done < n_out:
        room = max(0, min(k, max_new - done - 1))
        n = 0
        if room:
            if full:
                st["catch_up"] += 1
            while n < room and done - 1 + n < len(matches) and matches[done - 1 + n]:
                n += 1
            st["drafts"] += 1
            st["draft_tokens"] += room
            st["accepted"] += n
            for j in range(n):
                st["per_pos"][j] += 1
        full = bool(room) and n == room
        st["steps"] += 1
        done += n + 1
    return st


def replay_proposer(proposer, prompt: list[int], output: list[int], max_new: int, k: int,
                    acc: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine's ngram/suffix steps for one request (request id 0), driving the real
    proposer with the known greedy output: start, propose, extend with what was accepted plus
    the target's token, finish (so suffix decoding's cross-request cache grows as it would)."""
    st = acc if acc is not None else _new_stats(k)
    proposer.start(0, list(prompt) + output[:1])
    done = 1
    st["tokens"] += max(0, len(output) - 1)
    while done < len(output):
        room = max(0, min(k, max_new - done - 1))
        proposal = proposer.propose(0, room)
        n = 0
        while n < len(proposal) and done + n < len(output) and proposal[n] == output[done + n]:
            n += 1
        if proposal:
            st["drafts"] += 1
            st["draft_tokens"] += len(proposal)
            st["accepted"] += n
            for j in range(n):
                st["per_pos"][j] += 1
        st["steps"] += 1
        new = output[done:done + n + 1]
        done += n + 1
        if done < len(output):
            proposer.extend(0, new)
    proposer.finish(0)
    return st


def draft_matches(gen, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[bool]]:
    """One teacher-forced pass of the draft over each prompt and its greedy output: prefill the
    prompt in the bundle's chunks, then one single-token call per output token."""
    import numpy as np

    d = gen.draft
    b, p = d.batch_size, gen.manifest["shapes"]["prefill_seq_len"]
    out = []
    for ids, x in zip(prompts, outputs):
        for c in range(-(-len(ids) // p)):
            chunk = ids[c * p:(c + 1) * p]
            tok, pos = np.zeros((b, p), np.int64), np.full((b, p), -1, np.int64)
            tok[0, :len(chunk)] = chunk
            pos[0, :len(chunk)] = np.arange(c * p, c * p + len(chunk))
            d.run(tok, pos)
        m = []
        for i in range(len(x) - 1):
            tok, pos = np.zeros((b, 1), np.int64), np.full((b, 1), -1, np.int64)
            tok[0, 0], pos[0, 0] = x[i], len(ids) + i
            m.append(int(d.run(tok, pos)[0, 0].argmax()) == x[i + 1])
        out.append(m)
    return out


def replay(method: str, k: int, prompts: list[list[int]], outputs: list[list[int]],
           max_new: int, matches: list[list[bool]] | None = None,
           make_proposer: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Replayed statistics of the whole prompt set at K (one proposer for the set, in order)."""
    st = _new_stats(k)
    prop = make_proposer() if make_proposer else None
    for i, (ids, x) in enumerate(zip(prompts, outputs)):
        if method == "draft_model":
            replay_draft(matches[i], len(x), max_new, k, st)
        else:
            replay_proposer(prop, ids, x, max_new, k, st)
    st["alpha"] = conditional_acceptance(st["per_pos"], st["drafts"])
    st["proposal_fraction"] = st["drafts"] / st["steps"] if st["steps"] else 0.0
    return st


# ---------------------------------------------------------------- measuring
def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def lower_quartile(xs: list[float]) -> float:
    """The cost estimate: on a quiet machine it equals the median; when other work preempts the
    session's threads some calls take a whole scheduler slice longer, and longer calls (larger
    K) are hit more often, which would bias a median against large K."""
    xs = sorted(xs)
    if len(xs) < 4:
        return xs[0]
    return statistics.quantiles(xs, n=4, method="inclusive")[0]


def measure_costs(gen, ks: list[int], position: int, rounds: int = 20,
                  warmup: int = 3) -> tuple[dict[int, float], dict[int, float] | None,
                                            dict[str, Any]]:
    """Seconds per target verify of K+1 tokens (each K in ks, plus 0 when compiled) and, with a
    draft, per run of K draft steps, timed through the sessions at `position` the way the loop
    calls them: K draft steps back to back, then the verify. (A draft call that follows target
    calls runs with the target's weights in the CPU caches and is slower than the ones after it;
    timing single draft calls between target calls would overstate the draft's cost.) Each is the
    lower quartile of `rounds` samples, all Ks interleaved in every round."""
    import numpy as np

    target, draft = gen.target, gen.draft
    b = target.batch_size
    kset = sorted(set(ks) | ({0} if 0 in gen.ks else {min(gen.ks)}))
    pos0 = max(0, min(position, target.ctx_len - max(kset) - 2))
    samples: dict[int, list[float]] = {k: [] for k in kset}
    dsamples: dict[int, list[float]] = {k: [] for k in kset if k > 0}
    tok = 1
    for r in range(warmup + rounds):
        for k in kset:
            if draft is not None and k > 0:
                t0 = time.perf_counter()
                for j in range(k):
                    draft.run(np.full((b, 1), tok, np.int64), np.full((b, 1), pos0 + j, np.int64))
                if r >= warmup:
                    dsamples[k].append(time.perf_counter() - t0)
            ids = np.full((b, k + 1), tok, np.int64)
            pos = np.tile(np.arange(pos0, pos0 + k + 1, dtype=np.int64), (b, 1))
            t0 = time.perf_counter()
            target.run(ids, pos)
            dt = time.perf_counter() - t0
            if r >= warmup:
                samples[k].append(dt)
    t_verify = {k: lower_quartile(v) for k, v in samples.items()}
    t_draft = {k: lower_quartile(v) for k, v in dsamples.items()} if draft is not None else None
    detail = {"position": pos0, "rounds": rounds, "batch_size": b, "statistic": "lower quartile",
              "verify_ms": {k: round(t * 1e3, 4) for k, t in t_verify.items()},
              "verify_median_ms": {k: round(_median_ms(v), 4) for k, v in samples.items()},
              "verify_spread_ms": {k: [round(min(v) * 1e3, 4), round(max(v) * 1e3, 4)]
                                   for k, v in samples.items()},
              "draft_ms_for_k_steps": {k: round(t * 1e3, 4) for k, t in t_draft.items()}
              if t_draft else None,
              "draft_step_ms": round(t_draft[max(t_draft)] / max(t_draft) * 1e3, 4)
              if t_draft else None}
    return t_verify, t_draft, detail


def _run(gen, ids: list[list[int]], max_new_tokens: int, k: int | None,
         target_only: bool = False) -> dict[str, Any]:
    """Greedy generation over `ids` in batches; summed statistics."""
    batch, prefill = gen.target.batch_size, gen.manifest["shapes"]["prefill_seq_len"]
    t = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "target_calls": 0, "draft_calls": 0,
         "target_s": 0.0, "draft_s": 0.0, "e2e_s": 0.0, "prefill_s": 0.0, "host_s": 0.0,
         "new_tokens": 0, "rows": 0, "prefill_calls": 0, "per_pos": []}
    t["outputs"] = []
    for start in range(0, len(ids), batch):
        chunk = ids[start:start + batch]
        res = gen.generate(chunk, max_new_tokens, k=k, target_only=target_only)
        st = res.stats
        t["outputs"] += [r.tokens[len(r.prompt):] for r in res.rows]
        for key, src in (("drafts", "spec_decode_num_drafts"),
                         ("draft_tokens", "spec_decode_num_draft_tokens"),
                         ("accepted", "spec_decode_num_accepted_tokens"),
                         ("target_calls", "target_calls"), ("draft_calls", "draft_calls"),
                         ("target_s", "target_time_s"), ("draft_s", "draft_time_s"),
                         ("e2e_s", "e2e_s"), ("prefill_s", "ttft_s"),
                         ("host_s", "host_overhead_s"), ("new_tokens", "new_tokens"),
                         ("rows", "requests")):
            t[key] += st[src]
        t["prefill_calls"] += max(-(-len(p) // prefill) for p in chunk)
        for j, a in enumerate(st["spec_decode_num_accepted_tokens_per_pos"]):
            if j >= len(t["per_pos"]):
                t["per_pos"].append(0)
            t["per_pos"][j] += a
    t["steps"] = max(1, t["target_calls"] - t["prefill_calls"])
    t["host_per_step"] = t["host_s"] / t["steps"]
    decode_s = t["e2e_s"] - t["prefill_s"]
    t["decode_tokens_per_s"] = (t["new_tokens"] - t["rows"]) / decode_s if decode_s > 0 else None
    return t


def calibrate(bundle: Path, method: str, k_max: int, prompts: list[str], max_new_tokens: int,
              rounds: int = 20, check_prompts: int = 4, say: Say | None = None) -> dict[str, Any]:
    """Evidence and decision for `method` on `prompts`:

    1. target-only greedy decoding of every prompt (the output every K reproduces);
    2. acceptance: draft_model - one teacher-forced draft pass over each output; ngram/suffix -
       the proposer driven over the outputs; then the loop replayed at every K (per-position
       acceptance depends on K: acceptance comes in runs, and a larger K spends fewer steps on
       a run, so the steps it does take start more often where the proposer disagrees);
    3. real runs at K=1 and K_max on the first `check_prompts` prompts: the loop's own (host)
       time per step, and a check that the replay reproduces the measured acceptance;
    4. the costs of K draft steps and of a K+1 verify for every K (`measure_costs`);
    5. for each K: E(K) = 1 + sum_i prod_{j<=i} alpha_j(K) over the cost of a step; the best K.
    """
    from .bench import _new_proposer, target_only_generator
    from .runtime.loader import load

    say = say or (lambda m: None)
    gen = load(bundle, method=method, verify="fast")
    if k_max not in gen.ks:
        raise UsageError(f"K_max={k_max} is not compiled in the calibration bundle")
    ctx_len = gen.target.ctx_len
    room = ctx_len - max_new_tokens - 1
    if room < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} does not fit ctx_len {ctx_len}")
    ids = [gen.encode(p)[-room:] for p in prompts]
    sub = ids[:max(1, check_prompts)]
    base_gen = target_only_generator(gen)

    def fresh() -> None:  # the proposer's cross-request cache starts empty for each run
        if method != "draft_model":
            gen.decoder.proposer = _new_proposer(gen.manifest, method)

    gen.generate(ids[:1], min(max_new_tokens, 16), k=k_max)  # warm-up, not counted
    say(f"calibration: target-only greedy outputs of {len(ids)} prompts, {max_new_tokens} new "
        "tokens")
    base = _run(base_gen, ids, max_new_tokens, None, target_only=True)
    outputs = base["outputs"]
    matches = None
    if method == "draft_model":
        say("acceptance: one teacher-forced draft pass over every output")
        matches = draft_matches(gen, ids, outputs)
    ks = list(range(1, k_max + 1))
    make = (lambda: _new_proposer(gen.manifest, method)) if method != "draft_model" else None
    sims = {k: replay(method, k, ids, outputs, max_new_tokens, matches, make) for k in ks}
    say(f"host time per step and a check: {method} at K=1 and K={k_max} on {len(sub)} prompts")
    fresh()
    low = _run(gen, sub, max_new_tokens, 1)
    fresh()
    high = _run(gen, sub, max_new_tokens, k_max) if k_max > 1 else low
    base_sub = _run(base_gen, sub, max_new_tokens, None, target_only=True)
    position = int(statistics.median(len(p) for p in ids)) + max_new_tokens // 2
    say(f"timing K draft steps and one K+1 verify for K = 0..{k_max}: {rounds} rounds")
    t_verify, t_draft, detail = measure_costs(gen, ks, position, rounds)
    host = host_model({1: low["host_per_step"], k_max: high["host_per_step"]})
    rows = predict(method, {k: sims[k]["alpha"] for k in ks}, t_draft, t_verify, host,
                   {k: sims[k]["proposal_fraction"] for k in ks}, ks,
                   host_target_only=base_sub["host_per_step"])
    k = choose_k(rows)
    by_k = {r["k"]: r for r in rows}
    base_pred = 1.0 / (t_verify[min(t_verify)] + base_sub["host_per_step"])
    check = [{"config": "target-only", "predicted": round(base_pred, 1),
              "measured": _round(base_sub["decode_tokens_per_s"], 1)}]
    for kk, run in ((1, low), (k_max, high)):
        if kk == k_max and k_max == 1:
            continue
        sim = replay(method, kk, sub, outputs[:len(sub)], max_new_tokens, matches, make)
        check.append({"config": f"{method} K={kk}", "predicted": by_k[kk]["tokens_per_s"],
                      "measured": _round(run["decode_tokens_per_s"], 1),
                      "accepted_replayed": sim["accepted"], "accepted_measured": run["accepted"],
                      "drafts_replayed": sim["drafts"], "drafts_measured": run["drafts"]})
    for c in check:
        c["error"] = round(c["predicted"] / c["measured"] - 1, 4) if c["measured"] else None
    top = sims[k_max]
    return {
        "method": method, "k_max": k_max, "chosen_k": k, "recommended_ks": recommended_ks(method, k),
        "predicted_tokens_per_s": by_k[k]["tokens_per_s"],
        "predicted_speedup": by_k[k]["predicted_speedup"],
        "calibration": {
            "prompts": len(ids), "max_new_tokens": max_new_tokens,
            "new_tokens": base["new_tokens"],
            "acceptance_source": "teacher-forced draft pass" if matches is not None
            else "proposer driven over the outputs",
            "verify_steps": top["steps"], "num_drafts": top["drafts"],
            "num_draft_tokens": top["draft_tokens"], "num_accepted_tokens": top["accepted"],
            "accepted_per_pos": top["per_pos"],
            "acceptance_per_position": [round(a / top["drafts"], 4) if top["drafts"] else 0.0
                                        for a in top["per_pos"]],
            "alpha": [round(a, 4) for a in top["alpha"]],
            "proposal_fraction": round(top["proposal_fraction"], 4),
            "acceptance_rate": round(top["accepted"] / top["draft_tokens"], 4)
            if top["draft_tokens"] else None,
            "by_k": {kk: {"steps": sims[kk]["steps"], "drafts": sims[kk]["drafts"],
                          "accepted": sims[kk]["accepted"], "catch_up": sims[kk]["catch_up"],
                          "alpha": [round(a, 4) for a in sims[kk]["alpha"]],
                          "acceptance_per_position": [
                              round(a / sims[kk]["drafts"], 4) if sims[kk]["drafts"] else 0.0
                              for a in sims[kk]["per_pos"]]} for kk in ks},
        },
        "costs": {**detail,
                  "host_per_step_ms": {"target_only": round(base_sub["host_per_step"] * 1e3, 4),
                                       "k=1": round(low["host_per_step"] * 1e3, 4),
                                       f"k={k_max}": round(high["host_per_step"] * 1e3, 4)}},
        "model_check": check,
        "table": rows,
        "formula": ("draft_model: E(K) / (D(K) (1 + c(K) / K) + t_verify(K) + h(K)), D(K) = K "
                    "draft steps in a row as the loop runs them; "
                    "ngram/suffix: (p E(K) + 1 - p) / (p t_verify(K) + (1 - p) t_verify(0) + h(K)); "
                    "E(K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j(K), c(K) = prod_{j<=K} alpha_j(K), "
                    "alpha_j(K) from the loop replayed at K, h(K) = host time per step, linear "
                    "between the runs at K=1 and K=K_max"),
    }


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


def tune(recipe_path: Path, overrides: list[str] = (), *, k_max: int = DEFAULT_K_MAX,
         prompt_file: Path | None = None, prompt_set: str | None = None,
         num_prompts: int | None = None, prompts: list[str] | None = None,
         prompt_label: str | None = None, max_new_tokens: int = 128, rounds: int = 20,
         cache_dir: Path | None = None, say: Say | None = None) -> dict[str, Any]:
    """Recipe -> evidence and decision (a JSON-able dict). The calibration bundle is built in a
    temporary folder inside the build cache and removed afterwards."""
    from .bench import build_for_measurement, load_prompts, machine_info
    from .cache import Cache
    from .recipe import load_recipe

    say = say or (lambda m: None)
    if not 1 <= k_max <= 32:
        raise UsageError(f"--k-max must be in 1..32, got {k_max}")
    recipe_path = Path(recipe_path)
    r = load_recipe(recipe_path, list(overrides))
    method = r.draft.method
    if prompts is None:
        label, prompts = load_prompts(prompt_file, prompt_set, num_prompts)
    else:
        label, prompts = prompt_label or f"{len(prompts)} prompts", list(prompts)[:num_prompts]
    root = Cache(cache_dir).root
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tune-", dir=root))
    try:
        bundle = build_for_measurement(recipe_path, list(overrides), list(range(0, k_max + 1)),
                                       tmp / "calibration", cache_dir, say)
        evidence = calibrate(bundle, method, k_max, prompts, max_new_tokens, rounds,
                             say=say)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    current = r.speculation.num_speculative_tokens
    return {"tool": "qpcbuild tune", "recipe": str(recipe_path), "name": r.name,
            "overrides": list(overrides),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "prompt_set": label, "machine": machine_info(), "recipe_k": current, **evidence}


# ---------------------------------------------------------------- writing the decision
def evidence_comment(result: dict[str, Any]) -> list[str]:
    rows = {r["k"]: r for r in result["table"]}
    k = result["chosen_k"]
    others = sorted((r for r in result["table"] if r["k"] != k), key=lambda r: -r["tokens_per_s"])
    cal, costs = result["calibration"], result["costs"]
    lines = [f"{TUNE_MARK} K={k} chosen by `qpcbuild tune` ({result['created']}) on "
             f"{cal['prompts']} {result['prompt_set']} prompts, {result['method']}:",
             f"{TUNE_MARK} predicted {rows[k]['tokens_per_s']:,.0f} tokens/s "
             f"({rows[k]['predicted_speedup']:.2f}x target-only), "
             f"{rows[k]['expected_tokens_per_step']:.2f} tokens per step of "
             f"{rows[k]['cost_ms']:.3f} ms"
             + (f"; next best K={others[0]['k']} ({others[0]['vs_best']:+.1%})" if others else "")]
    at_k = _by_k(cal, k)
    lines.append(f"{TUNE_MARK} acceptance per position at K={k}: "
                 + " ".join(f"{a:.2f}" for a in (at_k or cal)["acceptance_per_position"])
                 + (f" (proposals in {cal['proposal_fraction']:.0%} of steps)"
                    if result["method"] != "draft_model" else ""))
    lines.append(f"{TUNE_MARK} verify ms by K: " + " ".join(
        f"{kk}:{v:.3f}" for kk, v in sorted(costs["verify_ms"].items(), key=lambda x: int(x[0])))
        + (f"; draft step {costs['draft_step_ms']:.3f} ms" if costs.get("draft_step_ms") else ""))
    return lines


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def patch_recipe_text(text: str, recipe, k: int, comment: list[str],
                      model_paths: dict[str, str] | None = None) -> str:
    """The recipe text with `speculation.num_speculative_tokens` set to K and the evidence as
    comment lines above it; every other line (and comment) is kept. `model_paths` replaces the
    values of target.model / draft.model (for a copy written to another folder)."""
    lines = text.splitlines()
    ks = recommended_ks(recipe.draft.method, k)
    compiled = str(ks) if len(ks) > 1 else ""
    keyed = getattr(recipe, "_lines", {})
    for role, new in (model_paths or {}).items():
        if (role, "model") in keyed:
            i = keyed[(role, "model")] - 1
            old = getattr(recipe, role).model
            m = re.search(r"model:\s*", lines[i])
            if m and old in lines[i][m.end():]:
                pos = m.end() + lines[i][m.end():].index(old)
                lines[i] = lines[i][:pos] + new + lines[i][pos + len(old):]

    def drop_old_comment(at: int) -> int:
        while at > 0 and lines[at - 1].lstrip().startswith(TUNE_MARK):
            del lines[at - 1]
            at -= 1
        return at

    if ("speculation", "num_speculative_tokens") in keyed:
        i = keyed[("speculation", "num_speculative_tokens")] - 1
        line = lines[i]
        m = re.match(r"^(\s*(?:-\s*)?num_speculative_tokens\s*:\s*)(.*)$", line)
        if not m:
            raise UsageError("cannot find `num_speculative_tokens:` at the start of line "
                             f"{i + 1}; rewrite the speculation block in block style")
        rest = m.group(2)
        value, _, trailing = rest.partition(" #")
        value = value.strip()
        end = i + 1
        if not value:  # a block sequence follows
            while end < len(lines) and lines[end].strip().startswith("-") \
                    and _indent(lines[end]) >= _indent(line):
                end += 1
        elif value.startswith("[") and "]" not in value:  # a flow list over several lines
            while end < len(lines) and "]" not in lines[end]:
                end += 1
            end = min(end + 1, len(lines))
        # The old inline comment described the old value; say what the new one compiles.
        note = "  # tuned (see above)" + (f"; compiled as {compiled}" if compiled else "")
        new = f"{m.group(1).rstrip()} {k}{note}"
        lines[i:end] = [new]
        at = drop_old_comment(i)
        pad = " " * _indent(lines[at])
        lines[at:at] = [pad + c for c in comment]
    elif ("speculation",) in keyed:
        i = keyed[("speculation",)] - 1
        if "{" in lines[i]:
            raise UsageError("the recipe's `speculation` is a flow mapping ({...}); write it in "
                             "block style so that tune can set num_speculative_tokens")
        child = next((_indent(x) for x in lines[i + 1:] if x.strip()
                      and not x.lstrip().startswith("#")), _indent(lines[i]) + 2)
        pad = " " * max(child, _indent(lines[i]) + 2)
        lines[i + 1:i + 1] = [pad + c for c in comment] + [f"{pad}num_speculative_tokens: {k}"]
    else:
        lines += ["", "speculation:"] + ["  " + c for c in comment] + \
            [f"  num_speculative_tokens: {k}"]
    return "\n".join(lines) + "\n"


def _rebased_models(recipe, dest_dir: Path) -> dict[str, str]:
    """Relative local model folders, re-expressed relative to dest_dir."""
    from .recipe import resolve_model_path

    out = {}
    roles = ["target"] + (["draft"] if recipe.draft.method == "draft_model" else [])
    for role in roles:
        ref = getattr(recipe, role).model
        if ref is None or Path(ref).expanduser().is_absolute():
            continue
        resolved = resolve_model_path(recipe, ref)
        if resolved != ref:  # a local folder
            dest = str(dest_dir.resolve())
            out[role] = resolved if os.path.commonpath([resolved, dest]) == os.sep \
                else os.path.relpath(resolved, dest)
    return out


def write_tuned_recipe(recipe_path: Path, result: dict[str, Any], dest: Path | None = None) -> Path:
    """Write the recipe with the chosen K: in place (dest None) or as a new recipe file at dest
    (relative model folders re-based so that the copy points at the same models). The result is
    re-read with `load_recipe` before anything is written."""
    from .recipe import load_recipe, recipe_from_text, resolve_model_path

    recipe_path = Path(recipe_path)
    r = load_recipe(recipe_path)
    text = recipe_path.read_text(encoding="utf-8")
    target = Path(dest) if dest else recipe_path
    rebase = _rebased_models(r, target.parent) \
        if target.parent.resolve() != recipe_path.parent.resolve() else {}
    k = result["chosen_k"]
    new_text = patch_recipe_text(text, r, k, evidence_comment(result), rebase)
    try:
        check = recipe_from_text(new_text, str(target), base_dir=target.parent.resolve())
    except RecipeError as exc:
        raise UsageError(f"the tuned recipe would not load ({exc}); not written") from None
    if check.speculation.num_speculative_tokens != k:
        raise RecipeError(str(target), [Problem("speculation.num_speculative_tokens",
                                                "rewriting the recipe did not set K")])
    for role in ("target", "draft"):
        a, b = getattr(r, role, None), getattr(check, role, None)
        if getattr(a, "model", None) and resolve_model_path(r, a.model) != \
                resolve_model_path(check, b.model):
            raise UsageError(f"the tuned recipe's {role}.model would point elsewhere; not written")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(new_text, encoding="utf-8")
    os.replace(tmp, target)
    return target


# ---------------------------------------------------------------- output
def _by_k(cal: dict[str, Any], k: int) -> dict[str, Any] | None:
    by_k = cal.get("by_k") or {}
    return by_k.get(k) or by_k.get(str(k))


def show_tune(result: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from .render import console as default_console
    console = console or default_console
    if not console.is_terminal:
        console = Console(width=150, highlight=False)
    cal, costs = result["calibration"], result["costs"]
    k_max = result["k_max"]
    console.print(f"[bold]tune {result['name']}[/]  method {result['method']}; "
                  f"{cal['prompts']} calibration prompts ({result['prompt_set']}), "
                  f"{cal['max_new_tokens']} new tokens; acceptance from a "
                  f"{cal.get('acceptance_source', 'calibration run')}, the loop replayed at "
                  f"each K")
    ev = Table("K", "steps", "with proposal", "accepted", *[f"a{j}" for j in range(1, k_max + 1)],
               title="acceptance evidence: alpha_j = P(position j accepted | j-1 accepted)",
               title_justify="left")
    for kk in range(1, k_max + 1):
        b = _by_k(cal, kk)
        if b is None:
            continue
        ev.add_row(str(kk), str(b["steps"]), str(b["drafts"]), str(b["accepted"]),
                   *[f"{a:.2f}" for a in b["alpha"]], *[""] * (k_max - len(b["alpha"])))
    console.print(ev)
    hs = costs["host_per_step_ms"]
    line = (f"costs, {costs.get('statistic', 'median')} of {costs['rounds']} rounds at position "
            f"{costs['position']}: verify K+1 ms " + " ".join(
                f"{kk}:{v:.3f}" for kk, v in sorted(costs["verify_ms"].items(),
                                                     key=lambda x: int(x[0]))))
    if costs.get("draft_ms_for_k_steps"):
        line += "; K draft steps ms " + " ".join(
            f"{kk}:{v:.3f}" for kk, v in sorted(costs["draft_ms_for_k_steps"].items(),
                                                key=lambda x: int(x[0])))
    line += "; host per step " + ", ".join(f"{k} {v:.3f} ms" for k, v in hs.items())
    console.print(line, soft_wrap=True)
    t = Table("K", "E[tokens/step]", "draft ms", "verify ms", "host ms", "step ms", "tokens/s",
              "vs target-only", "vs best", title="decision: expected tokens per second by K",
              title_justify="left")
    for r in result["table"]:
        mark = "[bold green]" if r["k"] == result["chosen_k"] else ""
        end = "[/]" if mark else ""
        t.add_row(f"{mark}{r['k']}{end}", f"{r['expected_tokens_per_step']:.3f}",
                  f"{r['draft_ms']:.3f}", f"{r['verify_ms']:.3f}", f"{r['host_ms']:.3f}",
                  f"{r['cost_ms']:.3f}", f"{mark}{r['tokens_per_s']:,.0f}{end}",
                  f"{r['predicted_speedup']:.2f}x", f"{r['vs_best']:+.1%}")
    console.print(t)
    parts = []
    for c in result["model_check"]:
        text = f"{c['config']} {c['predicted']:,.0f} vs {c['measured']:,.0f} tokens/s" + (
            f" ({c['error']:+.0%})" if c.get("error") is not None else "")
        if "accepted_replayed" in c:
            text += (f", accepted {c['accepted_replayed']} replayed vs {c['accepted_measured']} "
                     "measured")
        parts.append(text)
    console.print("model check (decode phase, first prompts): " + "; ".join(parts),
                  soft_wrap=True)
    console.print(f"[bold]K = {result['chosen_k']}[/] (recipe has {result['recipe_k']}); compile "
                  f"Ks {result['recommended_ks']} (num_speculative_tokens: {result['chosen_k']})")


def write_json(result: dict[str, Any], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path

"""`qpcbuild tune` end to end: recipe -> measurement bundles -> evidence -> the chosen K.

1. Acceptance: a bundle with every K in 0..K_max on ONNX Runtime, with the card's numerics
   emulated when the recipe asks for mxfp6 / mxint8 (acceptance does not depend on the
   hardware, only on the numbers); the target's greedy outputs of the calibration prompts, then
   the engine's loop replayed over them at every K (acceptance.py).
2. Costs (costs.py), with their source recorded: measured through the sessions of a bundle on
   the backend the recipe runs on when it is here (qaicrt on a card), otherwise on ONNX
   Runtime on this CPU; or, with --cost-model, a roofline estimate of the card.
3. Host time per step from real runs at K=1 and K_max (measured costs only), which also check
   that the replay reproduces the measured acceptance.
4. The decision model (model.py) per K, and per batch size with --per-batch.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ..backend_api import backend_info
from ..errors import UsageError
from ..recipe import CONFIDENT_METHODS
from .acceptance import replayed, summed_run
from .decision import (ROOFLINE, BatchChoice, ConfidenceStop, CostSource, Decision, Evidence,
                       KPrediction, ModelCheck, TuneRun)
from .model import (P_MIN_GRID, best_k_per_batch, choose_k, confidence_stop_table, host_model,
                    predict, recommended_ks)

Say = Callable[[str], None]
DEFAULT_K_MAX = 8
# (ks, position, batch size) -> (t_verify, t_draft, detail), as measure_costs returns them
CostFn = Callable[[list[int], int, int], tuple[dict[int, float], dict[int, float] | None,
                                              dict[str, Any]]]


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


# Over 80 lines: the calibration's steps in order (greedy outputs, the replay at every K, host
# time at K=1 and K_max, the prediction per batch size, the model check), then its JSON record.
def calibrate(bundle: Path, method: str, k_max: int, prompts: list[str], max_new_tokens: int,
              costs: CostFn, *, batches: list[int], host_measured: bool = True,
              same_bundle_costs: bool = True, check_prompts: int = 4,
              say: Say | None = None, verify: str = "full",
              cost_source: CostSource = "onnxruntime-cpu") -> Decision:
    """Evidence and decision for `method` on `prompts`. `costs` gives the call costs at a
    batch size; batches[0] is the one the decision is for, the others (--per-batch) get
    their best K too. host_measured False: the loop's own time per step is taken as 0 (a
    modelled card). same_bundle_costs: the costs come from this very bundle, so predicted and
    measured tokens/s can be compared."""
    from ..runtime.loader import load

    say = say or (lambda m: None)
    gen = load(bundle, method=method, verify=verify)
    if k_max not in gen.ks:
        raise UsageError(f"K_max={k_max} is not compiled in the calibration bundle")
    room = gen.target.ctx_len - max_new_tokens - 1
    if room < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} does not fit ctx_len "
                         f"{gen.target.ctx_len}")
    ids = [gen.encode(p)[-room:] for p in prompts]
    sub = ids[:max(1, check_prompts)]
    base_gen = gen.sibling(target_only=True)

    gen.generate(ids[:1], min(max_new_tokens, 16), k=k_max)  # warm-up, not counted
    say(f"calibration: target-only greedy outputs of {len(ids)} prompts, {max_new_tokens} new "
        "tokens")
    base = summed_run(base_gen, ids, max_new_tokens, None, target_only=True)
    outputs = base["outputs"]
    ks = list(range(1, k_max + 1))
    say(f"acceptance: the engine's loop replayed over the outputs at K = 1..{k_max}")
    sims = {k: replayed(gen, ids, outputs, max_new_tokens, k) for k in ks}
    say(f"host time per step and a check: {method} at K=1 and K={k_max} on {len(sub)} prompts")
    gen.fresh_proposer()
    low = summed_run(gen, sub, max_new_tokens, 1)
    gen.fresh_proposer()
    high = summed_run(gen, sub, max_new_tokens, k_max) if k_max > 1 else low
    base_sub = summed_run(base_gen, sub, max_new_tokens, None, target_only=True)
    position = int(statistics.median(len(p) for p in ids)) + max_new_tokens // 2
    if host_measured:
        host = host_model({1: low["host_per_step"], k_max: high["host_per_step"]})
        host_base = base_sub["host_per_step"]
    else:
        host, host_base = (lambda k: 0.0), 0.0
    alphas = {k: sims[k]["alpha"] for k in ks}
    fractions = {k: sims[k]["proposal_fraction"] for k in ks}
    tables, details, measured = {}, {}, {}
    head_call_s = _head_call_seconds(low, high)
    for b in batches:
        t_verify, t_draft, details[b] = costs(ks, position, b)
        if t_draft is None and head_call_s is not None:  # an EAGLE-3 head: K calls a step
            t_draft = {kk: kk * head_call_s for kk in ks}
            details[b] = {**details[b], "draft_ms_for_k_steps": {
                kk: round(t * 1e3, 4) for kk, t in t_draft.items()},
                "draft_step_ms": round(head_call_s * 1e3, 4),
                "draft_step_from": "the head's calls in the check runs"}
        measured[b] = (t_verify, t_draft)
        tables[b] = predict(method, alphas, t_draft, t_verify, host, fractions, ks,
                            host_target_only=host_base)
    rows, detail = tables[batches[0]], details[batches[0]]
    k = choose_k(rows)
    by_k = {r["k"]: r for r in rows}
    check = []
    if host_measured and same_bundle_costs:
        t_base = min(detail["verify_ms"].items(), key=lambda x: int(x[0]))[1] / 1e3
        check.append(ModelCheck("target-only", predicted=round(1.0 / (t_base + host_base), 1),
                                measured=_round(base_sub["decode_tokens_per_s"], 1)))
    for kk, run in ((1, low), (k_max, high)):
        if kk == k_max and k_max == 1:
            continue
        sim = replayed(gen, sub, outputs[:len(sub)], max_new_tokens, kk)
        check.append(ModelCheck(
            f"{method} K={kk}", measured=_round(run["decode_tokens_per_s"], 1),
            predicted=by_k[kk]["tokens_per_s"] if host_measured and same_bundle_costs else None,
            accepted_replayed=sim["accepted"], accepted_measured=run["accepted"],
            drafts_replayed=sim["drafts"], drafts_measured=run["drafts"]))
    top = sims[k_max]
    evidence = Evidence(
        calibration={
            "prompts": len(ids), "max_new_tokens": max_new_tokens,
            "new_tokens": base["new_tokens"],
            "acceptance_source": "the engine's loop replayed over the target's greedy outputs",
            "verify_steps": top["steps"], "num_drafts": top["drafts"],
            "num_draft_tokens": top["draft_tokens"], "num_accepted_tokens": top["accepted"],
            "accepted_per_pos": top["per_pos"],
            "acceptance_per_position": [round(a / top["drafts"], 4) if top["drafts"] else 0.0
                                        for a in top["per_pos"]],
            "alpha": [round(a, 4) for a in top["alpha"]],
            "proposal_fraction": round(top["proposal_fraction"], 4),
            "acceptance_rate": _round(top["acceptance_rate"], 4),
            "by_k": {kk: {"steps": sims[kk]["steps"], "drafts": sims[kk]["drafts"],
                          "accepted": sims[kk]["accepted"],
                          "draft_calls": sims[kk]["draft_calls"],
                          "alpha": [round(a, 4) for a in sims[kk]["alpha"]],
                          "acceptance_per_position": [
                              round(a / sims[kk]["drafts"], 4) if sims[kk]["drafts"] else 0.0
                              for a in sims[kk]["per_pos"]]} for kk in ks},
        },
        costs={**detail, "host_per_step_ms": {
            "target_only": round(host_base * 1e3, 4), "k=1": round(host(1) * 1e3, 4),
            f"k={k_max}": round(host(k_max) * 1e3, 4)}
            if host_measured else "not modelled (0)"},
        model_check=tuple(check),
        formula=("draft_model: E(K) / (D(K) (1 + c(K) / K) + t_verify(K) + h(K)), D(K) = K "
                    "draft steps in a row as the loop runs them; "
                    "ngram/suffix: (p E(K) + 1 - p) / (p t_verify(K) + (1 - p) t_verify(0) + h(K)); "
                    "E(K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j(K), c(K) = prod_{j<=K} alpha_j(K), "
                    "alpha_j(K) from the loop replayed at K, h(K) = host time per step, linear "
                 "between the runs at K=1 and K=K_max"),
    )
    per_batch = tuple(BatchChoice(**{**p, "table": tuple(p["table"])})
                      for p in best_k_per_batch(tables)) if len(batches) > 1 else ()
    stop = None
    if method in CONFIDENT_METHODS:
        say(f"confidence stop: the loop replayed at K={k_max} for draft_p_min in "
            f"{', '.join(f'{p:g}' for p in P_MIN_GRID)}")
        stop = _confidence_stop(gen, ids, outputs, max_new_tokens, k_max,
                                                  sims[k_max], measured[batches[0]],
                                                  host(k_max), host_base,
                                                  by_k[k]["tokens_per_s"])
    return Decision(method=method, k_max=k_max, chosen_k=k,
                    recommended_ks=tuple(recommended_ks(method, k)),
                    table=tuple(KPrediction.from_row(r) for r in rows), evidence=evidence,
                    cost_source=cost_source, per_batch=per_batch, confidence_stop=stop)


def _head_call_seconds(*runs: dict[str, Any]) -> float | None:
    """Seconds per proposer call measured in real runs of a method without a draft session
    whose proposer still makes calls of its own (an EAGLE-3 head: the engine counts them as
    draft calls); None when the runs made none."""
    calls = sum(run["draft_calls"] for run in runs)
    return sum(run["draft_s"] for run in runs) / calls if calls else None


def _confidence_stop(gen, ids, outputs, max_new_tokens, k_max, plain_sim, costs, host,
                     host_base, fixed_best) -> ConfidenceStop:
    """The best draft_p_min and the Ks it verifies in, against the best fixed K."""
    t_verify, t_draft = costs
    runs = {}
    for p in P_MIN_GRID:
        sim = plain_sim if p == 0 else replayed(gen, ids, outputs, max_new_tokens, k_max, p)
        runs[p] = {"tokens": sim["tokens"], "windows": sim["windows"],
                   "draft_calls": sim["draft_calls"]}
    per_call = t_draft[k_max] / k_max if isinstance(t_draft, dict) else (t_draft or 0.0)
    base_rate = 1.0 / (t_verify[min(t_verify)] + host_base)
    rows = confidence_stop_table(runs, t_verify, per_call, host, base_rate)
    best = max(rows, key=lambda r: (r["tokens_per_s"], -r["draft_p_min"]))
    return ConfidenceStop(draft_p_min=best["draft_p_min"], ks=tuple(best["ks"]),
                          predicted_tokens_per_s=best["tokens_per_s"],
                          predicted_speedup=best["predicted_speedup"],
                          beats_best_fixed_k=best["draft_p_min"] > 0
                          and best["tokens_per_s"] > fixed_best,
                          k_max=k_max, table=tuple(rows))


# Over 80 lines: builds the acceptance bundle and the cost bundles (per batch size, on the card or
# here) before calling calibrate; their clean-up must wrap them all.
def tune(recipe_path: Path, overrides: list[str] = (), *, k_max: int = DEFAULT_K_MAX,
         prompt_file: Path | None = None, prompt_set: str | None = None,
         num_prompts: int | None = None, prompts: list[str] | None = None,
         prompt_label: str | None = None, max_new_tokens: int = 128, rounds: int = 20,
         cache_dir: Path | None = None, say: Say | None = None, cost_model: bool = False,
         card_bandwidth_gbs: float | None = None, card_tflops: float | None = None,
         per_batch: list[int] | None = None, verify: str = "full") -> Decision:
    """Recipe -> evidence and decision. The measurement bundles are built in
    a temporary folder inside the build cache and removed afterwards."""
    from ..cache import Cache
    from ..measuring import (build_for_measurement, load_prompts, machine_info,
                             measurement_changes)
    from ..recipe import load_recipe
    from ..recipe.changes import RecipeChanges
    from ..runtime.loader import load
    from .costs import (ROOFLINE_ASSUMPTIONS, cost_backend, measure_costs, roofline_costs,
                        roofline_figures)

    say = say or (lambda m: None)
    if not 1 <= k_max <= 32:
        raise UsageError(f"--k-max must be in 1..32, got {k_max}")
    if (card_bandwidth_gbs is not None or card_tflops is not None) and not cost_model:
        raise UsageError("--card-bandwidth-gbs / --card-tflops go with --cost-model")
    for option, value in (("--card-bandwidth-gbs", card_bandwidth_gbs),
                          ("--card-tflops", card_tflops)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{option} must be a positive number, got {value}")
    recipe_path = Path(recipe_path)
    r = load_recipe(recipe_path, list(overrides))
    method = r.draft.method
    batch = r.shapes.full_batch_size or r.shapes.batch_size
    batches = [batch] + [b for b in sorted(set(per_batch or [])) if b != batch]
    if any(b < 1 for b in batches):
        raise UsageError("--per-batch sizes must be at least 1")
    if prompts is None:
        label, prompts = load_prompts(prompt_file, prompt_set, num_prompts)
    else:
        label, prompts = prompt_label or f"{len(prompts)} prompts", list(prompts)[:num_prompts]
    ks = list(range(0, k_max + 1))
    _, acceptance_on = measurement_changes(r, "card")
    notes: list[str] = []
    root = Cache(cache_dir).root
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tune-", dir=root))
    gens: dict[int, Any] = {}
    try:
        acc_bundle = build_for_measurement(recipe_path, list(overrides), ks,
                                           tmp / "acceptance", cache_dir, say, numerics="card")
        if cost_model:
            fig = roofline_figures(r, card_bandwidth_gbs, card_tflops)
            cost_source, same = ROOFLINE, False
            say(f"costs: roofline model of {fig['card']} ({fig['dram_gbs_per_qid']:g} GB/s and "
                f"{fig['fp16_tflops_per_qid']:g} fp16 TFLOPS per QID; {fig['source']})")
            for a in ROOFLINE_ASSUMPTIONS:
                say(f"  assumption: {a}")

            def costs(kk, position, b):
                return roofline_costs(r, kk, position, b, fig)
        else:
            backend, cost_source, why = cost_backend(r)
            if why:
                notes.append(f"the recipe builds for the card, but {why} here: call costs "
                             "were measured on ONNX Runtime on this CPU, so the K is this "
                             "CPU's; on the card it may differ (`tune --cost-model` estimates "
                             "the card)")
            on_card = not backend_info(backend).runs_on_host
            same = not on_card and \
                measurement_changes(r, "exact")[0] == measurement_changes(r, "card")[0]
            # A continuous-batching recipe is timed on its own bundle with b of its slots live
            # (a step's cost there is not a static batch-b bundle's: free slots cost little)
            cb = r.shapes.full_batch_size
            if cb and max(batches) > cb:
                raise UsageError(f"--per-batch {max(batches)} exceeds the recipe's "
                                 f"full_batch_size {cb}")
            for b in batches:
                if (b == batch and same) or (cb and b != batch):
                    continue
                extra = RecipeChanges() if b == batch else RecipeChanges(
                    shapes={"batch_size": b, "full_batch_size": None})
                out = tmp / f"costs-b{b}"
                if on_card:
                    from ..measuring import build_on_card
                    build_on_card(recipe_path, list(overrides), ks, out, cache_dir, say,
                                  changes=extra)
                else:
                    build_for_measurement(recipe_path, list(overrides), ks, out, cache_dir,
                                          say, numerics="exact", changes=extra)
                gens[b] = load(out, method=method, verify=verify, backend=backend)
            say(f"costs: measured on {cost_source}, {rounds} rounds per K")

            def costs(kk, position, b):
                g = gens.get(batch if cb else b)
                if g is None:  # the acceptance bundle, which is also the cost bundle
                    g = gens[batch if cb else b] = load(acc_bundle, method=method, verify=verify)
                say(f"timing K draft steps and one K+1 verify for K = 0..{k_max} at batch {b}"
                    + (f" ({b} of {cb} slots live)" if cb else ""))
                return measure_costs(g, kk, position, rounds, live=b if cb else None)
        decision = calibrate(acc_bundle, method, k_max, prompts, max_new_tokens, costs,
                             batches=batches, host_measured=not cost_model,
                             same_bundle_costs=same, say=say, verify=verify,
                             cost_source=cost_source)
    finally:
        gens.clear()
        shutil.rmtree(tmp, ignore_errors=True)
    return decision.with_run(TuneRun(
        recipe=str(recipe_path), name=r.name, overrides=tuple(overrides),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), prompt_set=label,
        machine=machine_info(), recipe_k=r.speculation.num_speculative_tokens,
        acceptance_measured_on=acceptance_on, notes=tuple(notes)))

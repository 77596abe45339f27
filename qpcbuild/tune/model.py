"""The decision model of `qpcbuild tune`, as pure functions of the evidence.

For each K: expected tokens per step E(K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j over the cost of
a step, and the K with the most tokens per second.

   draft_model:  cost(K) = D(K) (1 + c(K) / K) + t_verify(K) + h(K), where D(K) is K draft
                 steps in a row (as the loop runs them) and c(K) = prod_{j<=K} alpha_j: a step
                 that accepts all K drafts leaves the draft one token behind, which costs one
                 catch-up draft call in the next step.
   ngram/suffix: tokens(K) = p E(K) + (1 - p), cost(K) = p t_verify(K) + (1 - p) t_verify(0)
                 + h(K), where p is the fraction of steps that had a proposal (the compile list
                 [0, K] runs proposals of any length in the K+1 window, the others at K=0;
                 a list with Ks between verifies a short proposal in a smaller window, which
                 this model does not count).
   h(K), the loop's own time per step, is linear between the points it is known at.

The costs are given by the caller: measured on a backend, or modelled (see costs.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import UsageError
from ..runtime.gate import DEFAULT as GOODPUT


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
            # a model-free proposer costs nothing of its own; an EAGLE-3 head makes K calls in
            # a step that proposes (the catch-up proposes the first token), none in one that
            # does not
            steps = t_draft.get(k, 0.0) if isinstance(t_draft, dict) else k * (t_draft or 0.0)
            draft = p * steps if method == "eagle3" else 0.0
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


def best_k_per_batch(tables: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """{batch size: predict() rows} -> per batch size the best K, its tokens/s per sequence and
    over the batch (vLLM's num_speculative_tokens_per_batch_size idea). Not speculating (K=0,
    the rows' target-only rate) is a candidate too: a verify step's cost grows with the rows it
    carries, a step without speculation's much less (the rows share each weight's read), so at
    some batch size no K pays, and there the schedule stops speculating. A K must be predicted
    to beat not speculating by the goodput gate's margin, as the gate asks before it switches:
    the model's error is larger than that on host-bound pairs (the demo pair's K=3, predicted
    1.02x, measured 0.83x)."""
    out = []
    for b in sorted(tables):
        some = tables[b][0]
        plain = some["tokens_per_s"] / some["predicted_speedup"] if some["predicted_speedup"] \
            else 0.0
        rows = [{"k": 0, "cost_ms": round(1e3 / plain, 4) if plain else None,
                 "tokens_per_s": round(plain, 2), "predicted_speedup": 1.0}] + tables[b]
        best = next(r for r in rows if r["k"] == choose_k(rows))
        if best["predicted_speedup"] < 1 + GOODPUT.margin:
            best = rows[0]
        k = best["k"]
        out.append({"batch_size": b, "chosen_k": k,
                    "tokens_per_s_per_sequence": best["tokens_per_s"],
                    "tokens_per_s_batch": round(best["tokens_per_s"] * b, 2),
                    "predicted_speedup": best["predicted_speedup"],
                    "table": [{key: r[key] for key in ("k", "cost_ms", "tokens_per_s",
                                                       "predicted_speedup")} for r in rows]})
    return out


P_MIN_GRID = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
WINDOW_SHARE = 0.05  # a K is worth compiling when at least this share of steps verify in it


def confidence_stop_table(runs: dict[float, dict[str, Any]], t_verify: dict[int, float],
                          t_draft_call: float, host: float, base_rate: float
                          ) -> list[dict[str, Any]]:
    """Confidence-stopped drafting (draft_p_min) per threshold, from the loop replayed at K_max
    with that threshold: its tokens, its steps by verify window (each proposal verifies in the
    smallest compiled window holding it; all of 1..K_max are compiled for the replay) and its
    draft calls, priced with the measured costs: sum_w steps_w t_verify(w) + draft calls x
    t_draft + steps x h. The Ks to compile are the windows that at least WINDOW_SHARE of the
    steps used, and K_max."""
    rows = []
    for p_min, run in sorted(runs.items()):
        windows = {int(k): n for k, n in run["windows"].items()}
        steps = sum(windows.values())
        cost = sum(n * t_verify[k] for k, n in windows.items()) + \
            run["draft_calls"] * t_draft_call + steps * host
        rate = run["tokens"] / cost if cost > 0 else 0.0
        ks = sorted({k for k, n in windows.items() if n >= WINDOW_SHARE * steps} |
                    {max(windows)})
        rows.append({"draft_p_min": p_min, "tokens_per_s": round(rate, 2),
                     "predicted_speedup": round(rate / base_rate, 3) if base_rate else None,
                     "tokens_per_step": round(run["tokens"] / steps, 4) if steps else 0.0,
                     "draft_calls_per_step": round(run["draft_calls"] / steps, 3)
                     if steps else 0.0,
                     "steps_by_window": dict(sorted(windows.items())), "ks": ks})
    return rows

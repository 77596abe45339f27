"""Call costs for `qpcbuild tune`, each with its source.

* measured (`measure_costs`): timed through the sessions of a bundle, on the backend it was
  loaded for: qaicrt on a Cloud AI card when the recipe builds for qaic and the SDK is here
  (`cost_source: qaic-card`), otherwise ONNX Runtime on this CPU (`onnxruntime-cpu`);
* modelled (`roofline_costs`, `tune --cost-model`): a roofline estimate of the card from the
  recipe's shapes and precision and the card's published bandwidth and fp16 compute per QID
  (`roofline-model`); its assumptions travel with the numbers (`ROOFLINE_ASSUMPTIONS`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..bundle.backend import get_backend
from ..backend_api import HOST_BACKEND, backend_info, card_backend
from ..errors import UsageError
from ..runtime.model_session import padded_window

ROOFLINE_ASSUMPTIONS = [
    "each call reads every matmul weight of its role once (the layers and the LM head, a tied "
    "model's included; a draft's vocabulary subset keeps only its rows) at 2 bytes per "
    "parameter (fp16) or 25/32 byte (mxfp6), and of the fp16 embedding table only its tokens' "
    "rows",
    "each call reads the KV cache up to its position and writes its new tokens: 2 x layers x "
    "kv_heads x head_dim elements per token at 2 bytes (float16) or 33/32 byte (mxint8), times "
    "the batch",
    "weights and KV are split evenly over the role's device group; its QIDs work in parallel",
    "compute: 2 FLOPs per matmul parameter per token, at the card's fp16 peak per QID "
    "(attention over the context and activations ignored)",
    "a call takes max(bytes / bandwidth, FLOPs / peak): no launch, host-transfer or "
    "synchronisation time, and the host loop's own time per step is 0",
]


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
                  warmup: int = 3, live: int | None = None
                  ) -> tuple[dict[int, float], dict[int, float] | None, dict[str, Any]]:
    """Seconds per target verify of K+1 tokens (each K in ks, plus 0 when compiled) and, with a
    draft, per run of K draft steps, timed through the sessions at `position` the way the loop
    calls them: K draft steps back to back, then the verify. (A draft call that follows target
    calls runs with the target's weights in the CPU caches and is slower than the ones after it;
    timing single draft calls between target calls would overstate the draft's cost.) Each is the
    lower quartile of `rounds` samples, all Ks interleaved in every round. `live`: that many
    rows carry tokens and the others none (a continuous-batching bundle with free slots, timed
    as its steps run); default every row."""
    import numpy as np

    target, draft = gen.target, gen.draft
    b = target.batch_size
    free = np.arange(b)[:, None] >= (b if live is None else live)  # rows without a token
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
                    draft.run(np.full((b, 1), tok, np.int64),
                              np.where(free, -1, np.full((b, 1), pos0 + j, np.int64)))
                if r >= warmup:
                    dsamples[k].append(time.perf_counter() - t0)
            # the window the engine sends: K+1 tokens, padded to the target's floor (an
            # int8/int4 target runs a lone token as 2)
            ids = np.full((b, padded_window(target, k + 1)), tok, np.int64)
            window = np.full(ids.shape[1], -1, np.int64)
            window[:k + 1] = np.arange(pos0, pos0 + k + 1)
            pos = np.where(free, -1, np.tile(window, (b, 1)))
            t0 = time.perf_counter()
            target.run(ids, pos)
            dt = time.perf_counter() - t0
            if r >= warmup:
                samples[k].append(dt)
    t_verify = {k: lower_quartile(v) for k, v in samples.items()}
    t_draft = {k: lower_quartile(v) for k, v in dsamples.items()} if draft is not None else None
    detail = {"position": pos0, "rounds": rounds, "batch_size": b,
              **({"live_rows": live} if live is not None else {}), "statistic": "lower quartile",
              "verify_ms": {k: round(t * 1e3, 4) for k, t in t_verify.items()},
              "verify_median_ms": {k: round(_median_ms(v), 4) for k, v in samples.items()},
              "verify_spread_ms": {k: [round(min(v) * 1e3, 4), round(max(v) * 1e3, 4)]
                                   for k, v in samples.items()},
              "draft_ms_for_k_steps": {k: round(t * 1e3, 4) for k, t in t_draft.items()}
              if t_draft else None,
              "draft_step_ms": round(t_draft[max(t_draft)] / max(t_draft) * 1e3, 4)
              if t_draft else None}
    return t_verify, t_draft, detail


def cost_backend(r) -> tuple[str, str, str | None]:
    """(backend to time on, cost_source, why not the card): the card when the recipe builds for
    one and its runtime and compiler are here, else the host backend on this CPU."""
    host = HOST_BACKEND, backend_info(HOST_BACKEND).cost_source
    card = card_backend(r.backends)
    if card is None:
        return *host, None
    why = get_backend(card).runtime_problem()
    if why is None:
        return card, backend_info(card).cost_source, None
    return *host, why


def roofline_figures(r, bandwidth_gbs: float | None = None,
                     tflops: float | None = None) -> dict[str, Any]:
    """Bandwidth and fp16 compute per QID for the recipe's card: the published table, or the
    caller's figures (required where the table has none)."""
    from ..recipe import CARD_ROOFLINE, CARD_ROOFLINE_SOURCE

    known = CARD_ROOFLINE.get(r.hardware.card) if r.hardware.aic_hw_version == "ai100" else None
    if known is None and (bandwidth_gbs is None or tflops is None):
        raise UsageError(f"no published bandwidth/compute figures here for {r.hardware.card} "
                         f"({r.hardware.aic_hw_version}); give --card-bandwidth-gbs and "
                         "--card-tflops (per QID)")
    bw = bandwidth_gbs if bandwidth_gbs is not None else known["dram_gbs_per_qid"]
    peak = tflops if tflops is not None else known["fp16_tflops_per_qid"]
    if bw <= 0 or peak <= 0:
        raise UsageError("--card-bandwidth-gbs and --card-tflops must be positive")
    given = [x for x, v in (("bandwidth", bandwidth_gbs), ("compute", tflops)) if v is not None]
    return {"card": r.hardware.card, "aic_hw_version": r.hardware.aic_hw_version,
            "dram_gbs_per_qid": bw, "fp16_tflops_per_qid": peak,
            "source": CARD_ROOFLINE_SOURCE if not given else
            f"given on the command line ({', '.join(given)})"
            + (f"; the rest: {CARD_ROOFLINE_SOURCE}" if len(given) < 2 else "")}


def roofline_call_s(role, r, tokens: int, position: int, batch: int,
                    fig: dict[str, Any]) -> dict[str, float]:
    """Seconds of one call of `role` (a plan RolePlan) with `tokens` new tokens per row."""
    from ..plan import KV_BYTES, WEIGHT_BYTES

    arch, n_dev = role.arch, len(role.device_group)
    head_rows = role.vocab_subset.size if role.vocab_subset else None
    # A call reads every MatMul weight, but only the embedding rows of its own tokens.
    matmul_params = arch.matmul_param_count(head_rows)
    weights = (matmul_params * WEIGHT_BYTES[r.precision.quantization]
               + tokens * batch * arch.hidden_size * 2.0) / n_dev
    kv = arch.kv_bytes_per_token(KV_BYTES[r.precision.kv_cache_dtype]) \
        * (position + tokens) * batch / n_dev
    flops = 2.0 * matmul_params * tokens * batch / n_dev
    mem_s = (weights + kv) / (fig["dram_gbs_per_qid"] * 1e9)
    compute_s = flops / (fig["fp16_tflops_per_qid"] * 1e12)
    return {"weight_bytes": weights, "kv_bytes": kv, "flops": flops, "memory_s": mem_s,
            "compute_s": compute_s, "seconds": max(mem_s, compute_s)}


def roofline_costs(r, ks: list[int], position: int, batch: int, fig: dict[str, Any]
                   ) -> tuple[dict[int, float], dict[int, float] | None, dict[str, Any]]:
    """measure_costs' outputs, modelled: seconds per target verify of K+1 tokens (0 and each K)
    and per K draft steps, for the recipe on its card at `position`, per ROOFLINE_ASSUMPTIONS."""
    from ..plan import make_plan

    plan = make_plan(r)
    target, draft = plan.role("target"), plan.role("draft")
    kset = sorted(set(ks) | {0})
    verify = {k: roofline_call_s(target, r, k + 1, position, batch, fig) for k in kset}
    step = roofline_call_s(draft, r, 1, position, batch, fig) if draft is not None else None
    t_verify = {k: v["seconds"] for k, v in verify.items()}
    t_draft = {k: k * step["seconds"] for k in kset if k > 0} if step else None
    detail = {"position": position, "batch_size": batch, "statistic": "roofline model",
              "figures": fig, "assumptions": ROOFLINE_ASSUMPTIONS,
              "verify_ms": {k: round(t * 1e3, 6) for k, t in t_verify.items()},
              "verify_bound": {k: "memory" if v["memory_s"] >= v["compute_s"] else "compute"
                               for k, v in verify.items()},
              "target_call": {key: verify[min(kset)][key] for key in ("weight_bytes",
                                                                      "kv_bytes", "flops")},
              "draft_ms_for_k_steps": {k: round(t * 1e3, 6) for k, t in t_draft.items()}
              if t_draft else None,
              "draft_step_ms": round(step["seconds"] * 1e3, 6) if step else None,
              "draft_call": {key: step[key] for key in ("weight_bytes", "kv_bytes", "flops")}
              if step else None}
    return t_verify, t_draft, detail

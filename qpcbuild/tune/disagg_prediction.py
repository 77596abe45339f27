"""What a disaggregated recipe should do on its card, from the roofline cost model (costs.py):
the KV hand-off's bytes per prompt length and their time over a link whose speed the caller
gives, and how long the decode node's slots wait when a prompt is admitted, against an
aggregated deployment of the same pair.

Nothing here is measured. The link speed is an input: no bandwidth for the path vllm-qaic's
QaicConnector takes between the prefill and the decode QIDs is recorded in this project, so
the caller states one and every output repeats it as an assumption."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import UsageError
from .costs import ROOFLINE_ASSUMPTIONS, roofline_call_s

ASSUMPTIONS = [
    *ROOFLINE_ASSUMPTIONS,
    "the hand-off moves the prompt's KV but its last token (the decode node recomputes it): "
    "2 x layers x kv_heads x head_dim elements per position at the KV precision's bytes",
    "the link's speed is the caller's figure, not a measurement; the hand-off takes bytes / "
    "speed, with no setup, protocol or copy-in time",
    "a prefill runs in prefill_seq_len chunks, each a roofline call at its position",
    "aggregated: the decode node's target runs the prompt's prefill itself, so every slot it "
    "decodes waits that long; the draft's prefill waits in both layouts (vllm-qaic's draft "
    "proposer prefills and decodes on the decode node, one after the other)",
    "whether writing the handed-off KV into the decode QPC pauses a decode step depends on "
    "QaicConnector and is not modelled: the link time is its upper bound if it does",
]


@dataclass(frozen=True)
class AdmissionCost:
    """One prompt length's hand-off and the wait it puts on the decode node's slots."""
    prompt_tokens: int
    handoff_bytes: int  # on the card, at the KV precision
    link_s: float  # handoff_bytes over the assumed link
    prefill_s: float  # the target's prefill on the prefill node
    draft_prefill_s: float  # the draft's, on the decode node (0: no draft)
    decode_wait_aggregated_s: float  # target + draft prefill on the decode node
    decode_wait_disaggregated_s: float  # the draft's prefill only
    decode_step_s: float  # one verify step of the decode node's slots

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _prefill_s(role: Any, r: Any, tokens: int, fig: dict[str, Any]) -> float:
    chunk = r.shapes.prefill_seq_len
    return sum(roofline_call_s(role, r, chunk, start, 1, fig)["seconds"]
               for start in range(0, tokens, chunk))


def admission_costs(r: Any, lengths: list[int], link_gbps: float, fig: dict[str, Any],
                    position: int | None = None) -> list[AdmissionCost]:
    """r: a disaggregated Recipe; fig: costs.roofline_figures(r); position: where the decode
    step reads the KV up to (default: half of ctx_len)."""
    from ..plan import KV_BYTES, make_plan
    from ..recipe.placement import node_slots

    if r.disaggregated is None:
        raise UsageError(f"{r.name}: not a disaggregated recipe (no `disaggregated:` block)")
    if not link_gbps > 0:
        raise UsageError(f"--link-gbps must be a positive number of Gbit/s, got {link_gbps}")
    too_long = [n for n in lengths if not 2 <= n < r.shapes.ctx_len]
    if too_long:
        raise UsageError(f"prompt length {too_long[0]}: must be 2..{r.shapes.ctx_len - 1} "
                         "(ctx_len)")
    plan = make_plan(r)
    prefill, target, draft = plan.role("prefill"), plan.target, plan.role("draft")
    assert prefill is not None  # a disaggregated plan has the prefill unit
    per_position = target.arch.kv_bytes_per_token(KV_BYTES[r.precision.kv_cache_dtype])
    slots = node_slots(r, "target")
    k = max(r.ks)
    step_s = roofline_call_s(target, r, k + 1, position if position is not None else
                             r.shapes.ctx_len // 2, slots, fig)["seconds"]
    out = []
    for n in lengths:
        nbytes = round(per_position * (n - 1))
        draft_s = _prefill_s(draft, r, n, fig) if draft is not None else 0.0
        out.append(AdmissionCost(
            prompt_tokens=n, handoff_bytes=nbytes, link_s=nbytes * 8 / (link_gbps * 1e9),
            prefill_s=_prefill_s(prefill, r, n - 1, fig), draft_prefill_s=draft_s,
            decode_wait_aggregated_s=_prefill_s(target, r, n, fig) + draft_s,
            decode_wait_disaggregated_s=draft_s, decode_step_s=step_s))
    return out

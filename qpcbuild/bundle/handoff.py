"""The KV hand-off contract of a disaggregated bundle: what the prefill unit's retained KV state
must look like for the decode unit to take it over (docs/disaggregated.md). The build writes it
into the manifest from the plan; reading a manifest (and so `verify` and every load) derives the
same facts again from each unit's own recorded fields and refuses a unit that disagrees, naming
the field. A module of its own (pydantic and the backends by name only), below
manifest_model.py which calls it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..backend_api import card_backend
from ..recipe.placement import node_slots

if TYPE_CHECKING:
    from ..plan import BuildPlan

# vllm-qaic's name for the KV buffers of a QPC served with a kv_transfer_config
# (QEfficient's apply_kv_cache_prefix): past_key.{i}_vllmKvCache[_RetainedState]
VLLM_KV_INFIX = "vllmKvCache"
# the units that hold the target's KV: it crosses from the first to the second
KV_UNITS = ("prefill", "target")
UNIT_NAMES = {"prefill": "prefill/target", "target": "decode/target", "draft": "decode/draft"}


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class KvHandoff(_Part):
    """What both target units agree on. Per layer, the hand-off is a [1, kv_heads, n_tokens,
    head_dim] slice of each buffer (in `buffers` order) for one request's slot."""
    buffers: list[str] = Field(min_length=1)  # the graph's KV inputs, key then value per layer
    vllm_buffer_infix: str = VLLM_KV_INFIX  # as vllm-qaic names them when it transfers KV
    # The same buffers as the card units' graphs and custom_io name them (`buffers` with the
    # infix: past_key.0_vllmKvCache); absent where the bundle has no card backend
    card_buffers: Optional[list[str]] = None
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    kv_dtype: str  # on the device (custom_io Precision; the host artifacts hold float32)
    ctx_len: int = Field(ge=2)
    # Sliding layers keep a ctx_len-long buffer like full ones (their mask hides old keys), so
    # every layer hands off the same [0, n_tokens) positions; None: no layer slides.
    sliding_window: Optional[int] = None
    sliding_rule: Literal["full-buffer"] = "full-buffer"
    # The prefill unit samples nothing: its KV holds positions [0, n - 1) and the decode unit
    # runs the last prompt token itself, which gives the first output token.
    last_prompt_token: Literal["recomputed-on-decode"] = "recomputed-on-decode"


class DisaggUnit(_Part):
    role: str  # roles.<role> of the manifest
    device_group: list[int]
    num_cores: int = Field(ge=1)
    slots: int = Field(ge=1)  # KV slots of the unit's node (max_num_seqs)


class Disaggregated(_Part):
    distinct_hosts: bool = False
    units: dict[str, DisaggUnit]  # prefill/target, decode/target[, decode/draft]
    # Both target units are compiled from one exported graph: its weights' digest
    weights_digest: str
    graph: str  # the graph's path in the bundle (qaic) or the export that made it
    kv_handoff: KvHandoff


def unit_facts(role: Any) -> dict[str, Any]:
    """The contract's fields as one unit's own manifest fields give them (role: a manifest Role;
    typed Any, as manifest_model.py, which calls this while validating, imports this module)."""
    specs = role.specializations
    ctx = sorted({s.size("ctx_len") for s in specs})
    slots = sorted({s.size("full_batch_size" if "full_batch_size" in s.symbols else "batch_size")
                    for s in specs})
    on_card = [names for entry in role.backends.values()
               if (names := entry.device_kv_buffers()) is not None]
    return {"buffers": [e.name for e in role.io.inputs if e.name.startswith("past_")],
            "card_buffers": on_card[0] if on_card else None,
            "kv_heads": role.arch.num_kv_heads, "head_dim": role.arch.head_dim,
            "kv_dtype": role.precision.kv_cache, "ctx_len": ctx[0] if len(ctx) == 1 else ctx,
            "sliding_window": (role.arch.model_extra or {}).get("sliding_window"),
            "slots": slots[-1]}


def contract_problems(d: Disaggregated, roles: Mapping[Any, Any]) -> list[str]:
    """Where a unit disagrees with the hand-off contract or its node, each naming the field."""
    out: list[str] = []
    contract = d.kv_handoff.model_dump()
    infixed = [f"{b}_{d.kv_handoff.vllm_buffer_infix}" for b in d.kv_handoff.buffers]
    if contract["card_buffers"] not in (None, infixed):
        out.append(f"disaggregated.kv_handoff.card_buffers: not the buffers named with the "
                   f"infix {d.kv_handoff.vllm_buffer_infix!r} ({infixed[0]}, ...)")
    for unit, info in d.units.items():
        if info.role not in roles:
            out.append(f"disaggregated.units.{unit}: no roles.{info.role}")
    for name in KV_UNITS:
        role = roles.get(name)
        if role is None:
            out.append(f"disaggregated: no roles.{name} ({UNIT_NAMES[name]})")
            continue
        facts = unit_facts(role)
        for key, value in facts.items():
            if key == "card_buffers" and value is None:
                continue  # the unit was not built for a card here
            if key in contract and value != contract[key]:
                out.append(f"roles.{name} ({UNIT_NAMES[name]}): {key} {value} is not the KV "
                           f"hand-off contract's {contract[key]} (disaggregated.kv_handoff."
                           f"{key})")
        node = d.units.get(UNIT_NAMES[name])
        if node is not None and facts["slots"] != node.slots:
            out.append(f"roles.{name}: compiled for {facts['slots']} KV slots, not its node's "
                       f"{node.slots} (disaggregated.units.{UNIT_NAMES[name]}.slots)")
        digest = role.source.weights_digest
        if digest is not None and digest != d.weights_digest:
            out.append(f"roles.{name}.source.weights_digest: not the one export both target "
                       f"units are compiled from (disaggregated.weights_digest)")
    return out


def manifest_record(plan: "BuildPlan", weights_digest: str) -> dict[str, Any]:
    """The manifest's `disaggregated` object, from the plan alone (the recipe's shapes and
    precision, the target's architecture and graph), so each unit is checked against what was
    asked for rather than against another unit."""
    r, target = plan.recipe, plan.target
    assert r.disaggregated is not None  # (called for disaggregated recipes only)
    arch = target.arch
    buffers = [e.name for e in target.io.inputs if e.name.startswith("past_")]
    contract = KvHandoff(
        buffers=buffers, kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        kv_dtype=r.precision.kv_cache_dtype, ctx_len=r.shapes.ctx_len,
        sliding_window=arch.sliding_window,
        card_buffers=([f"{b}_{VLLM_KV_INFIX}" for b in buffers]
                      if card_backend(r.backends) is not None else None))
    units = {rp.unit: DisaggUnit(role=rp.role, device_group=list(rp.device_group),
                                 num_cores=rp.num_cores, slots=node_slots(r, rp.role))
             for rp in plan.roles}
    record = Disaggregated(distinct_hosts=r.disaggregated.distinct_hosts, units=units,
                           weights_digest=weights_digest, graph="target/onnx/model.onnx",
                           kv_handoff=contract).model_dump(mode="json")
    if contract.card_buffers is None:  # a host-only bundle's record is as before
        del record["kv_handoff"]["card_buffers"]
    return record

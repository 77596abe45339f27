"""Where each unit runs: the devices and cores per QID of the target and the draft (under
`hardware`), or of the three units of a disaggregated recipe (under `disaggregated`), their
checks and the core split. A module of its own below the package's __init__.py, which calls
`_placement` among the recipe's static checks and re-exports the rest."""

from __future__ import annotations

from typing import Callable

from .schema import CARD_BACKENDS, CARDS, Disaggregated, Recipe, RoleHardware

Add = Callable[..., None]  # add(key path, message, severity="error")


def head_on_card(r: Recipe) -> bool:
    """Whether an EAGLE-3 head is compiled for a card beside its target: it then runs as a
    draft model would, on the draft's devices and its share of the cores (`hardware.draft`).
    On the host it takes none, so an ONNX Runtime-only recipe places the target as before."""
    return r.draft.method == "eagle3" and any(b in CARD_BACKENDS for b in r.backends)


def placements(r: Recipe) -> dict[str, tuple[str, RoleHardware]]:
    """Each unit's devices and cores as the recipe places them, with the key that does: the
    roles under `hardware` (an EAGLE-3 head on a card as the draft: head_on_card), or the
    three units of `disaggregated` (prefill is the target's prefill unit; target and draft
    decode)."""
    h, dis = r.hardware, r.disaggregated
    has_draft = r.draft.method == "draft_model" or head_on_card(r)
    if dis is None:
        return {"target": ("hardware.target", h.target),
                **({"draft": ("hardware.draft", h.draft)} if has_draft else {})}
    return {"prefill": ("disaggregated.prefill", dis.prefill),
            "target": ("disaggregated.decode.target", dis.decode.target),
            **({"draft": ("disaggregated.decode.draft", dis.decode.draft)} if has_draft else {})}


def _placement(r: Recipe, add: Add) -> None:
    """Devices and cores per unit on the recipe's cards."""
    h, d = r.hardware, r.draft
    card = CARDS[h.card]
    n_qids = card["qids"] * h.num_cards
    units = placements(r)
    for key, hw in units.values():
        if len(set(hw.device_group)) != len(hw.device_group):
            add(f"{key}.device_group", f"duplicate device ids in {hw.device_group}")
        for i, qid in enumerate(hw.device_group):
            if qid < 0 or qid >= n_qids:
                add(f"{key}.device_group[{i}]", f"device {qid} is outside the "
                    f"{n_qids} QIDs of {h.num_cards} x {h.card} (0..{n_qids - 1})")
        if hw.num_cores is not None and hw.num_cores > card["cores_per_qid"]:
            add(f"{key}.num_cores", f"{hw.num_cores} cores exceed the "
                f"{card['cores_per_qid']} per QID of {h.card}")
    if "draft" in units:
        (_, t), (draft_key, dh) = units["target"], units["draft"]
        shared = set(t.device_group) & set(dh.device_group)
        cores = resolved_cores(r)
        if shared and cores["target"] + cores["draft"] > card["cores_per_qid"]:
            draft = "EAGLE-3 head" if head_on_card(r) else "draft"
            add(f"{draft_key}.num_cores", f"target {cores['target']} + {draft} {cores['draft']} "
                f"cores exceed the {card['cores_per_qid']} cores of shared QID(s) {sorted(shared)}"
                + ("; give the head cores of the target's (hardware.target.num_cores) or "
                   "devices of its own (hardware.draft.device_group)" if head_on_card(r) else ""))
    elif r.hardware.draft != RoleHardware() or \
            (r.disaggregated and r.disaggregated.decode.draft != RoleHardware()):
        key = "disaggregated.decode.draft" if r.disaggregated else "hardware.draft"
        add(key, f"method '{d.method}' has no draft model to place", "warning")
    if r.disaggregated is not None:
        _disaggregated(r, r.disaggregated, add)


def _disaggregated(r: Recipe, dis: Disaggregated, add: Add) -> None:
    """The two nodes: apart unless on distinct hosts; slots only with continuous batching."""
    for role in ("target", "draft"):
        if getattr(r.hardware, role) != RoleHardware():
            add(f"hardware.{role}", f"a disaggregated recipe places the {role} under "
                f"disaggregated.decode.{role} (and the prefill node under "
                "disaggregated.prefill); remove this key")
    decode_qids = set(dis.decode.target.device_group)
    if r.draft.method == "draft_model":
        decode_qids |= set(dis.decode.draft.device_group)
    overlap = sorted(set(dis.prefill.device_group) & decode_qids)
    if overlap and not dis.distinct_hosts:
        add("disaggregated.prefill.device_group", f"QID(s) {overlap} are in both the prefill "
            "and the decode node's groups; give the nodes separate devices, or set "
            "disaggregated.distinct_hosts: true if they are on different machines")
    s = r.shapes
    for key, slots in (("disaggregated.prefill.max_num_seqs", dis.prefill.max_num_seqs),
                       ("disaggregated.decode.max_num_seqs", dis.decode.max_num_seqs)):
        if slots is not None and s.full_batch_size is None and slots != s.batch_size:
            add(key, f"{slots} slots need continuous batching (shapes.full_batch_size); "
                f"without it a node has shapes.batch_size = {s.batch_size}")


def node_slots(r: Recipe, unit: str) -> int:
    """KV slots (the KV buffers' first dimension) of a unit's node: the node's max_num_seqs,
    else the shapes' (full_batch_size with continuous batching, else batch_size)."""
    s, dis = r.shapes, r.disaggregated
    default = s.full_batch_size or s.batch_size
    if dis is None:
        return default
    node = dis.prefill.max_num_seqs if unit == "prefill" else dis.decode.max_num_seqs
    return node or default


def _pair_cores(per_qid: int, t: RoleHardware, d: RoleHardware | None) -> dict[str, int]:
    """Cores per QID of a target and its draft (None: no draft). Shared QIDs with no explicit
    split: half each (8/8)."""
    if d is None:
        return {"target": t.num_cores or per_qid}
    shared = bool(set(t.device_group) & set(d.device_group))
    if not shared:
        return {"target": t.num_cores or per_qid, "draft": d.num_cores or per_qid}
    if t.num_cores is None and d.num_cores is None:
        return {"target": per_qid // 2, "draft": per_qid - per_qid // 2}
    if t.num_cores is None:
        assert d.num_cores is not None  # (not both None: above)
        return {"target": max(1, per_qid - d.num_cores), "draft": d.num_cores}
    if d.num_cores is None:
        return {"target": t.num_cores, "draft": max(1, per_qid - t.num_cores)}
    return {"target": t.num_cores, "draft": d.num_cores}


def resolved_cores(r: Recipe) -> dict[str, int]:
    """Cores per QID for each unit (target, draft; and prefill when disaggregated)."""
    per_qid = CARDS[r.hardware.card]["cores_per_qid"]
    units = placements(r)
    pair = _pair_cores(per_qid, units["target"][1], units["draft"][1] if "draft" in units
                       else None)
    if "prefill" not in units:
        return pair
    return {"prefill": units["prefill"][1].num_cores or per_qid, **pair}

"""The `vllm serve` settings a bundle implies (the speculative config, the served model, a
role's qaic placement): what both serve-config renderings, aggregated and disaggregated, read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest, Role


def speculative_config(m: Manifest) -> dict[str, Any] | None:
    spd = m.speculation
    k = max(m.ks)
    schedule = vllm_k_schedule(m)
    extra = {"num_speculative_tokens_per_batch_size": schedule} if schedule else {}
    if spd.method == "draft_model":
        return {"method": "draft_model", "model": served_model(m.draft),
                "num_speculative_tokens": k, **extra}
    if k == 0:
        return None
    return {"method": spd.method, "num_speculative_tokens": k, **spd.options, **extra}


def vllm_k_schedule(m: Manifest) -> list[list[int]] | None:
    """The bundle's K per live batch size as vLLM's num_speculative_tokens_per_batch_size:
    inclusive [first, last, K] ranges from batch size 1 to the compiled batch (fewer live rows
    than the first scheduled size use the largest compiled K, as qpcbuild's engine does)."""
    points = m.speculation.schedule
    if not points:
        return None
    top = max(m.shapes.kv_batch, max(points))
    if min(points) > 1:
        points[1] = max(m.ks)
    starts = sorted(points)
    return [[b, (starts[i + 1] - 1) if i + 1 < len(starts) else top, points[b]]
            for i, b in enumerate(starts)]


def served_model(role: Role) -> str:
    """vLLM loads config and tokenizer by model id; smoke builds name the model they stand in for
    (the build records that name as the role's reference)."""
    return role.source.ref


def qaic_config(role: Role) -> dict[str, Any]:
    return {"device_group": role.device_group, "num_cores": role.num_cores}

"""The ONNX Runtime backend's planning: the role's `ort` settings (the artifact, its graph
lowering, shapes and numerics, how the runtime drives it), its cache key and warnings."""

from __future__ import annotations

from typing import Any

from ..recipe import CARDS, Recipe
from .interface import RoleFacts

ORT_LOWERING_VERSION = "2"  # bump when the onnxruntime artifact changes for the same graph


def ort_graph(r: Recipe) -> str:
    """fused (qpcbuild's lowering on ORT's fused kernels) or portable (the exported graph, as
    the card compiles it), as the recipe says. With several rows (a static batch, or continuous
    batching's slots) the runtime runs the fused graph's multi-token windows once per live row
    over that row's KV (ORT's CPU GroupQueryAttention refuses batch > 1 for them) and its
    single-token calls once over all rows (runtime/session.py, RowwiseOrtSession)."""
    return r.onnxruntime.graph


def ort_batch(r: Recipe) -> int | str:
    """The batch dim of the onnxruntime graph: the bundle's rows for the portable graph; for the
    fused graph 1 with one row, else symbolic ("batch_size"): single-token calls (draft steps,
    steps without speculation) then go through it for all rows at once, which ORT's
    GroupQueryAttention allows (multi-token windows go row by row)."""
    rows = r.shapes.full_batch_size or r.shapes.batch_size
    if ort_graph(r) != "fused":
        return rows
    return 1 if rows == 1 else "batch_size"


def ort_numerics(r: Recipe) -> dict[str, Any]:
    """What the onnxruntime artifact computes with: `exact` float32, or `emulated` card formats
    (qpcbuild.numerics) when the recipe asks for mxfp6 / mxint8. Emulation exists in the fused
    lowering only; a portable ORT graph next to the qaic backend stays exact (the recipe refuses
    emulation on a portable graph without qaic)."""
    from ..numerics import KV_FORMAT, WEIGHT_FORMAT

    p = r.precision
    if (p.quantization == "none" and p.kv_cache_dtype == "float16") or ort_graph(r) != "fused":
        return {"numerics": "exact", "numerics_formats": {"weights": "float32", "kv": "float32"}}
    return {"numerics": "emulated", "numerics_formats": {
        "weights": WEIGHT_FORMAT if p.quantization == "mxfp6" else "float32",
        "kv": KV_FORMAT if p.kv_cache_dtype == "mxint8" else "float32"}}


class OrtPlan:
    def plan_role(self, r: Recipe, facts: RoleFacts, compiler: str | None) -> dict[str, Any]:
        role = facts.role
        return {"ort": {
            "artifact": f"{role}/ort/model.onnx",
            "batch_size": ort_batch(r),
            "ctx_len": r.shapes.ctx_len, "kv_dtype": "float32", "graph": ort_graph(r),
            "weights": getattr(r.onnxruntime, f"{role}_weights"),
            "core_share": facts.cores / CARDS[r.hardware.card]["cores_per_qid"],
            "intra_op_threads": r.onnxruntime.intra_op_threads, **ort_numerics(r)}}

    def settings(self, r: Recipe, facts: RoleFacts, planned: dict[str, Any]) -> dict[str, Any]:
        ort = planned["ort"]
        # Only what changes the artifact is in: K and threads do not change an onnxruntime
        # artifact, so they are not in its key.
        return {"export": facts.export_key, "lowering": ORT_LOWERING_VERSION,
                **{k: ort[k] for k in ("graph", "batch_size", "ctx_len", "kv_dtype", "weights")},
                # emulated card formats (exact builds keep their key)
                **({"numerics": ort["numerics_formats"]} if ort["numerics"] == "emulated"
                   else {})}

    def warnings(self, r: Recipe, configs: dict[str, dict[str, Any]]) -> list[str]:
        out = []
        if ort_graph(r) != "fused" and (
                r.precision.quantization != "none" or r.precision.kv_cache_dtype != "float16"):
            out.append("onnxruntime: the portable graph runs exact float32; the mxfp6/mxint8 "
                       "numerics preview exists in the fused graph only")
        return out

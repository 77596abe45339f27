"""The ONNX Runtime backend's planning: the role's `ort` settings (the artifact, its graph
lowering, shapes and numerics, how the runtime drives it), its cache key and warnings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...recipe.schema import CARDS, Recipe
from ...backend_api import BackendPart, RoleFacts
from ...errors import Problem
from ...models.arch import ArchSpec

ORT_LOWERING_VERSION = "2"  # bump when the onnxruntime artifact changes for the same graph
MOE_FORM = "com.microsoft.MoE"  # a MoE model's experts in the artifact (manifest, cache key)


def uses_moe_op(arch: ArchSpec) -> bool:
    """Whether the onnxruntime artifact runs this model's routed layers on ONNX Runtime's MoE
    kernel (moe.py): every MoE family but one whose experts' activation the kernel lacks (it has
    SwiGLU only)."""
    return bool(arch.num_experts) and (arch.stacked_experts or arch.hidden_act == "silu")


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
    from ...numerics import KV_FORMAT, WEIGHT_FORMAT

    p = r.precision
    if (p.quantization == "none" and p.kv_cache_dtype == "float16") or ort_graph(r) != "fused":
        return {"numerics": "exact", "numerics_formats": {"weights": "float32", "kv": "float32"}}
    return {"numerics": "emulated", "numerics_formats": {
        "weights": WEIGHT_FORMAT if p.quantization == "mxfp6" else "float32",
        "kv": KV_FORMAT if p.kv_cache_dtype == "mxint8" else "float32"}}


@dataclass(frozen=True)
class OrtPart(BackendPart):
    """The role's ONNX Runtime artifact as planned: what it is built from and how it runs."""
    artifact: str  # relative to the bundle root
    batch_size: int | str  # a number, or "batch_size" where it stays symbolic (ort_batch)
    ctx_len: int
    kv_dtype: str
    graph: str  # fused | portable (ort_graph)
    weights: str  # the fused graph's matmul weights: float32 | int8 | int4
    block_size: int | None  # int8/int4 blocks along K (None: nbits.INT8_BLOCK)
    core_share: float  # of a QID's cores: the role's share of the host's threads
    intra_op_threads: int | None
    numerics: str  # exact | emulated (ort_numerics)
    numerics_formats: dict[str, str]

    def describe(self, r: Recipe, n_devices: int, built: bool) -> list[str]:
        if not built:
            return []
        per_role = self.intra_op_threads
        threads = (f"{per_role} CPU threads per role" if per_role
                   else "all CPU threads (one pool both roles share)")
        emulated = (f"; numerics emulated (weights {self.numerics_formats['weights']}, "
                    f"KV {self.numerics_formats['kv']})" if self.numerics == "emulated" else "")
        return [f"[bold]onnxruntime[/]: {self.artifact} with batch_size={self.batch_size}, "
                f"ctx_len={self.ctx_len} fixed, {self.graph} graph, {self.kv_dtype} KV, "
                f"{threads}{emulated}"]

    def manifest_role_fields(self) -> dict[str, Any]:
        # How the runtime drives the artifact; its shapes and format are recorded once, in
        # `shapes` and in backends.onnxruntime.
        return {"ort": {"core_share": self.core_share,
                        "intra_op_threads": self.intra_op_threads}}


def _layout_key(role: str, part: "OrtPart") -> dict[str, Any]:
    """A quantized role's MatMulNBits layout where it is not the earlier one (a target's, or
    a draft's with a block size of its own)."""
    from .nbits import nbits_layout

    changed = (nbits_layout(role, part.block_size).changed() if part.weights != "float32"
               else {})
    return {"nbits": changed} if changed else {}


def _head_key(r: Recipe, role: str) -> dict[str, Any]:
    """An EAGLE-3 head's weight format where it is not float32, and its graph's form where it is
    the fused one (eagle3_graph.py; the head's graph is built beside the target's artifact, in
    the target's form), so that other bundles keep their ids."""
    if role != "target" or r.draft.method != "eagle3":
        return {}
    from .eagle3_graph import HEAD_GRAPH  # (a graph module: imported for eagle3 recipes only)
    from .nbits import nbits_layout

    fmt = r.onnxruntime.draft_weights
    layout = nbits_layout("draft", r.onnxruntime.draft_block_size).changed()
    return {**({"eagle3_head_weights": fmt} if fmt != "float32" else {}),
            **({"eagle3_head_nbits": layout} if fmt != "float32" and layout else {}),
            **({"eagle3_head_graph": HEAD_GRAPH} if ort_graph(r) == "fused" else {})}


class OrtPlan:
    def plan_role(self, r: Recipe, facts: RoleFacts, compiler: str | None) -> OrtPart:
        role = facts.role
        numerics = ort_numerics(r)
        return OrtPart(
            artifact=f"{role}/ort/model.onnx", batch_size=ort_batch(r),
            ctx_len=r.shapes.ctx_len, kv_dtype="float32", graph=ort_graph(r),
            weights=getattr(r.onnxruntime, f"{facts.model_role}_weights"),
            block_size=getattr(r.onnxruntime, f"{facts.model_role}_block_size"),
            core_share=facts.cores / CARDS[r.hardware.card]["cores_per_qid"],
            intra_op_threads=r.onnxruntime.intra_op_threads,
            numerics=numerics["numerics"], numerics_formats=numerics["numerics_formats"])

    def settings(self, r: Recipe, facts: RoleFacts, part: OrtPart) -> dict[str, Any]:
        # Only what changes the artifact is in: K and threads do not change an onnxruntime
        # artifact, so they are not in its key.
        return {"export": facts.export_key, "lowering": ORT_LOWERING_VERSION,
                "graph": part.graph, "batch_size": part.batch_size, "ctx_len": part.ctx_len,
                "kv_dtype": part.kv_dtype, "weights": part.weights,
                **_layout_key(facts.model_role, part),
                **_head_key(r, facts.model_role),
                # emulated card formats (exact builds keep their key)
                **({"numerics": part.numerics_formats} if part.numerics == "emulated" else {})}

    def problems(self, r: Recipe, role: str, arch: ArchSpec) -> list[Problem]:
        if r.onnxruntime.graph != "fused":
            return []
        fused_problem = arch.fused_ort_problem(r.shapes.ctx_len)
        if fused_problem:
            return [Problem("onnxruntime.graph", f"the {role} ({arch.family}): {fused_problem}; "
                            "set `onnxruntime: {graph: portable}` (the exported graph, exact)",
                            r.line_of("onnxruntime.graph"))]
        return _fused_experts_problems(r, role, arch)

    def warnings(self, r: Recipe, configs: dict[str, dict[str, Any]]) -> list[str]:
        out = []
        if ort_graph(r) != "fused" and (
                r.precision.quantization != "none" or r.precision.kv_cache_dtype != "float16"):
            out.append("onnxruntime: the portable graph runs exact float32; the mxfp6/mxint8 "
                       "numerics preview exists in the fused graph only")
        return out


def _fused_experts_problems(r: Recipe, role: str, arch: ArchSpec) -> list[Problem]:
    """The fused lowering runs routed layers on ONNX Runtime's MoE kernel in float32: it has no
    int8/int4 (MatMulNBits) or MXFP6 form of the experts, so a recipe asking for one is refused
    rather than given float32 experts silently."""
    if not arch.num_experts:
        return []
    out = []
    key = f"onnxruntime.{role}_weights"
    if getattr(r.onnxruntime, f"{role}_weights") != "float32":
        out.append(Problem(key, f"the {role} ({arch.family}) has routed layers, which the fused "
                           "lowering runs in float32 on ONNX Runtime's MoE kernel; set it to "
                           "float32", r.line_of(key)))
    if r.precision.quantization == "mxfp6":
        out.append(Problem("precision.quantization", f"the {role} ({arch.family}) has routed "
                           "layers, which the fused lowering cannot emulate in MXFP6; use "
                           "`onnxruntime: {graph: portable}` beside qaic, or quantization: none",
                           r.line_of("precision.quantization")))
    return out


PLAN = OrtPlan()

"""The embedded default backend: a ready-to-load ONNX Runtime artifact per role.

The portable graph gets the plan's fixed shapes (batch, ctx_len) baked in, is optimized offline
by ONNX Runtime for the CPU execution provider, and is saved with its weights in one external
file: one graph serves every specialization (seq_len stays symbolic), so weights are stored once.
The runtime enforces the specializations recorded in the manifest, exactly as the card does.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ...cache import META, Cache
from ...errors import Terminated, ToolchainError
from ...export import DATA_FILE, EAGLE3_DIR, GRAPH_FILE
from ...ort_threads import session_options
from ...plan import RolePlan
from ...toolchain import package_version
from ...bundle.backend import BuildContext
from .plan import MOE_FORM, ORT_LOWERING_VERSION, OrtPart, uses_moe_op

ORT_LEVEL = "extended"  # "all" adds layout rewrites tied to the building CPU; not portable


def fix_dims(model_path: Path, fixed: dict[str, int], out_path: Path) -> None:
    """Replace symbolic dims (batch_size, ctx_len, ...) by the plan's values, and the card
    graph's dialect by what ONNX Runtime accepts (export/dialect.py, for_onnxruntime)."""
    import onnx  # here, not above: a compile whose artifacts are all cached never loads it

    from ...export.dialect import for_onnxruntime

    model = onnx.load(str(model_path), load_external_data=False)
    for_onnxruntime(model)
    for value in list(model.graph.input) + list(model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in fixed:
                dim.dim_value = fixed[dim.dim_param]
    out_path.write_bytes(model.SerializeToString(deterministic=True))


class OrtBackend:
    name = "onnxruntime"
    cache_kind = "ort"
    ships_graph = False  # the artifact holds its own weights

    def check(self, ctx: BuildContext) -> dict[str, Any]:
        try:
            import onnxruntime  # noqa: F401  (whether it imports is the check)
        except ImportError as exc:
            if Terminated.requested:  # SIGTERM arrived while the extension was initializing
                raise Terminated() from None
            raise ToolchainError(f"onnxruntime is not importable: {exc}") from None
        return {"onnxruntime": package_version("onnxruntime"), "optimization_level": ORT_LEVEL}

    def runtime_problem(self) -> str | None:
        return None  # onnxruntime is a dependency: it runs wherever qpcbuild does

    def key_inputs(self, role: RolePlan, export_digest: str, tools: dict[str, Any],
                   compiler: str | None, emit_only: bool) -> dict[str, Any]:
        # A MoE model's portable artifact runs its experts on the MoE kernel (moe.py): its own
        # key, while every other model's stays as it was.
        experts = {"experts": MOE_FORM} if uses_moe_op(role.arch) \
            and self.part(role).graph == "portable" else {}
        return {"export": export_digest, "settings": role.cache_keys.backends[self.name],
                "lowering": ORT_LOWERING_VERSION, "onnxruntime": tools["onnxruntime"],
                "onnx": tools["onnx"], **experts}

    def build_cached(self, ctx: BuildContext, role: RolePlan, cache: Cache, key: str,
                     inputs: dict[str, Any], onnx_dir: Callable[[], Path]) -> tuple[dict, bool]:
        # Built in the cache's scratch folder, then delivered into the bundle.
        def build(tmp: Path) -> dict[str, Any]:
            return self.build(replace(ctx, staging=tmp, delivered=None), role,
                              onnx_dir())

        entry, info, reused = cache.get_or_build(self.cache_kind, key, build, inputs)
        cache.deliver(entry, ctx.staging, skip=(META,), known=ctx.delivered)
        return info, reused

    @staticmethod
    def part(role: RolePlan) -> OrtPart:
        """This backend's part of the role's plan."""
        part = role.backends[OrtBackend.name]
        assert isinstance(part, OrtPart)  # planned by .plan.OrtPlan
        return part

    def build(self, ctx: BuildContext, role: RolePlan, onnx_dir: Path) -> dict[str, Any]:
        if role.eagle3 is not None:  # first: a portable head copies the embedding, which the
            self.build_eagle3_head(ctx, role, onnx_dir)  # lowering frees from a spent export
        if self.part(role).graph == "fused":
            return self.build_fused(ctx, role, onnx_dir)
        return self.build_portable(ctx, role, onnx_dir)

    def build_eagle3_head(self, ctx: BuildContext, role: RolePlan, onnx_dir: Path) -> None:
        """The EAGLE-3 head's graph beside the target's artifact (`<role>/ort/eagle3/`), in the
        target's form: a fused target's head on the fused kernels, reading the target's own
        token embedding (eagle3_graph.py), where its head_dim fits them; else in plain
        operators with a copy of that embedding (export/eagle3.py)."""
        from ...export.eagle3 import export_head
        from .eagle3_graph import export_fused_head, fits_fused
        from .nbits import WEIGHT_BITS, matmul_nbits, nbits_layout
        from .weights import PortableWeights

        assert role.eagle3 is not None
        a = role.arch
        head = role.eagle3.read(a)
        # onnxruntime.draft_weights: the head is the proposer, so its numerics change only
        # which tokens it proposes (a draft's layout, the fastest)
        weights = ctx.plan.recipe.onnxruntime.draft_weights
        bits = WEIGHT_BITS.get(weights)
        layout = nbits_layout("draft", ctx.plan.recipe.onnxruntime.draft_block_size)
        project = None if bits is None else (
            lambda g, x, name, w, out: matmul_nbits(g, x, name, w, bits, layout, out))
        out = ctx.staging / role.role / "ort" / EAGLE3_DIR
        if self.part(role).graph == "fused" and fits_fused(head.info):
            export_fused_head(head, a.max_position_embeddings, out, project or (
                lambda g, x, name, w, out: g.op("MatMul", x, g.weight(name, w), out=out)),
                weights)
        else:
            embed = PortableWeights(onnx_dir / GRAPH_FILE).get("model.embed_tokens.weight")
            export_head(head, embed, a.max_position_embeddings, out, project, weights)

    def build_fused(self, ctx: BuildContext, role: RolePlan, onnx_dir: Path) -> dict[str, Any]:
        out = ctx.staging / role.role / "ort"
        import onnx

        from .nbits import INT8_BLOCK, nbits_layout
        from .ort_graph import PortableWeights, build_ort_graph

        weights = PortableWeights(onnx_dir / GRAPH_FILE, spend=ctx.spend_export)
        source = onnx.load(str(onnx_dir / GRAPH_FILE), load_external_data=False)
        metadata = {p.key: p.value for p in source.metadata_props}
        ort = self.part(role)
        batch, ctx_len = ort.batch_size, ort.ctx_len
        layout = nbits_layout(role.model_role, ort.block_size)
        build_ort_graph(role.arch, weights, role.model_role, batch, ctx_len, out,
                        {**metadata, "ort_graph": "fused"}, ort.weights,
                        ort.numerics_formats if ort.numerics == "emulated" else None,
                        layout=layout)
        # the runtime pads a lone token to this window (recorded only where it is not 1, so
        # other bundles' manifests stay as they were)
        floor = layout.min_window if ort.weights != "float32" else 1
        experts = {"experts": MOE_FORM} if uses_moe_op(role.arch) else {}
        return {"status": "compiled", "artifact": f"{role.role}/ort/{GRAPH_FILE}", **experts,
                "graph": "fused", "kv_binding": "in_place", "weights": ort.weights,
                **({"min_window": floor} if floor > 1 else {}),
                **({"block_size": layout.block_size} if ort.weights != "float32"
                   and layout.block_size != INT8_BLOCK else {}),
                **({"window_step": layout.window_step} if ort.weights != "float32"
                   and layout.window_step > 1 else {}),
                # exact float32, or the card's mxfp6 / mxint8 emulated (qpcbuild.numerics)
                "numerics": ort.numerics,
                "numerics_formats": dict(ort.numerics_formats),
                "fixed_dims": {"ctx_len": ctx_len, **({"batch_size": batch}
                                                      if isinstance(batch, int) else {})},
                "execution_provider": "CPUExecutionProvider"}

    def build_portable(self, ctx: BuildContext, role: RolePlan, onnx_dir: Path) -> dict[str, Any]:
        import onnxruntime as ort

        from .moe import rebuild_with_moe_op

        out = ctx.staging / role.role / "ort"
        work = ctx.staging / role.role / ".ort-work"
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        shape = ctx.plan.recipe.shapes
        fixed = {"batch_size": shape.batch_size, "ctx_len": shape.ctx_len}
        if shape.full_batch_size:
            fixed = {"full_batch_size": shape.full_batch_size, "ctx_len": shape.ctx_len}
        # The fixed-shape copy must sit beside the weights it references.
        try:  # ORT refuses external data reached through a symlink; a hard link is a real file
            os.link(onnx_dir / DATA_FILE, work / DATA_FILE)
        except OSError:
            shutil.copyfile(onnx_dir / DATA_FILE, work / DATA_FILE)
        experts = {}
        if uses_moe_op(role.arch):  # the routed layers on ORT's MoE kernel, not dense
            fix_dims(rebuild_with_moe_op(onnx_dir, work, role.arch), fixed, work / GRAPH_FILE)
            experts = {"experts": MOE_FORM}
        else:
            fix_dims(onnx_dir / GRAPH_FILE, fixed, work / GRAPH_FILE)

        so, _ = session_options(1)  # optimizing a graph needs no threads
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(out / GRAPH_FILE)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    DATA_FILE)
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        try:
            ort.InferenceSession(str(work / GRAPH_FILE), so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ToolchainError(f"onnxruntime could not optimize the {role.role} graph: "
                                 f"{exc}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return {"status": "compiled", "artifact": f"{role.role}/ort/{GRAPH_FILE}",
                "graph": "portable", "kv_binding": "ping_pong",
                "numerics": "exact", "numerics_formats": {"weights": "float32", "kv": "float32"},
                "fixed_dims": fixed, "optimization_level": ORT_LEVEL,
                "execution_provider": "CPUExecutionProvider", **experts}


BUILDER = OrtBackend

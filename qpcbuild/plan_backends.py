"""What each compile backend needs decided at plan time: the settings its artifact's cache key
is the digest of, and the warnings its recipe settings earn.

The layers put compile above plan (a backend reads the plan), so the plan cannot ask a compile
backend; these facts sit here, one layer below the plan, one entry per backend under the same
names as compile/backends.py (tests/test_backend_names.py checks the two agree). The plan loops
over them and never names a backend.
"""

from __future__ import annotations

from typing import Any, Protocol

from .recipe import Recipe

ORT_LOWERING_VERSION = "2"  # bump when the onnxruntime artifact changes for the same graph


def ort_graph(r: Recipe) -> str:
    """The fused lowering needs one row per call: ORT's CPU GroupQueryAttention refuses
    batch > 1 for multi-token windows over a cache, and only the portable graph has the
    batch_index input of continuous batching."""
    if r.shapes.full_batch_size is not None or r.shapes.batch_size > 1:
        return "portable"
    return r.onnxruntime.graph


class BackendPlan(Protocol):
    def settings(self, r: Recipe, export_key: str, ort: dict[str, Any], argv: list[str],
                 specs: list[dict[str, Any]]) -> dict[str, Any]:
        """The settings part of the artifact's cache key (the plan digests it; the build adds
        the weights' content digest and the toolchain versions)."""

    def warnings(self, r: Recipe, configs: dict[str, dict[str, Any]]) -> list[str]:
        """What the plan warns about when the recipe builds for this backend (configs: each
        role's config.json)."""


class _OrtPlan:
    def settings(self, r, export_key, ort, argv, specs):
        # Only what changes the artifact is in: K and threads do not change an onnxruntime
        # artifact, so they are not in its key.
        return {"export": export_key, "lowering": ORT_LOWERING_VERSION,
                **{k: ort[k] for k in ("graph", "batch_size", "ctx_len", "kv_dtype", "weights")},
                # emulated card formats (exact builds keep their key)
                **({"numerics": ort["numerics_formats"]} if ort["numerics"] == "emulated"
                   else {})}

    def warnings(self, r, configs):
        out = []
        if r.onnxruntime.graph == "fused" and ort_graph(r) != "fused":
            out.append("onnxruntime: batch_size > 1 or continuous batching uses the portable "
                       "graph (the fused GroupQueryAttention lowering runs one row per call)")
        if ort_graph(r) != "fused" and (
                r.precision.quantization != "none" or r.precision.kv_cache_dtype != "float16"):
            out.append("onnxruntime: the portable graph runs exact float32; the mxfp6/mxint8 "
                       "numerics preview exists in the fused graph only (batch_size 1)")
        return out


class _QaicPlan:
    def settings(self, r, export_key, ort, argv, specs):
        return {"export": export_key, "argv": argv[1:], "specs": specs,
                "custom_io": r.precision.kv_cache_dtype,
                "fmt": r.hardware.specializations_format}

    def warnings(self, r, configs):
        out = []
        if r.precision.export_dtype == "float16":
            out.append("qaic: export_dtype float16 Casts each stored weight up to float32 in "
                       "front of its MatMul, a form QEfficient's graphs never have (`qpcbuild "
                       "doctor` flags it; whether -mxfp6-matmul compresses such weights is "
                       "unknown): prefer float32 for a card bundle")
        if r.hardware.aic_hw_version == "ai200":
            for role, config in configs.items():
                if (config.get("torch_dtype") or config.get("dtype")) == "bfloat16":
                    out.append(f"{role}: a bfloat16 checkpoint on ai200 runs in bfloat16 under "
                               "QEfficient (no -convert-to-fp16, bfloat16 KV); this bundle's "
                               "graph is its exact float32 upcast, compiled to float16 as "
                               "QEfficient compiles float32 checkpoints")
        return out


# Every backend's key is in every role's plan (`qpcbuild plan` shows them all), whichever the
# recipe builds for; its warnings only when the recipe builds for it.
BACKEND_PLANS: dict[str, BackendPlan] = {"onnxruntime": _OrtPlan(), "qaic": _QaicPlan()}

"""The ONNX Runtime backend's manifest entry (how the runtime drives the artifact, roles.<role>.ort,
every role of a bundle records: bundle/manifest_model.py's OrtRole)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from ...backend_api import BackendEntry


class OrtEntry(BackendEntry):
    status: Literal["compiled"]
    artifact: str
    graph: Optional[str] = None  # fused (qpcbuild's lowering) | portable (ORT-optimized export)
    kv_binding: Literal["in_place", "ping_pong"] = "ping_pong"
    weights: Literal["float32", "int8", "int4"] = "float32"  # the fused graph's matmul weights
    # the fewest tokens a call carries (a lone token is padded): an int8/int4 target's, whose
    # logits must not depend on the window (nbits.TARGET_NBITS)
    min_window: int = Field(default=1, ge=1)
    # int8/int4 blocks along K where they are not 32 (recorded only then)
    block_size: Optional[Literal[64, 128]] = None
    # a multiple every call's window is padded to: 2 for a target in such blocks, whose integer
    # kernel runs a call's rows in pairs and an odd last row alone (nbits.TARGET_NBITS)
    window_step: int = Field(default=1, ge=1)
    numerics: Optional[str] = None
    numerics_formats: Optional[dict[str, str]] = None

    def problems(self, role: dict[str, Any]) -> list[str]:
        return [] if role.get("ort") else ["built for onnxruntime, but has no ort settings"]

    def host_bytes(self, param_count: int, kv_bytes_per_token: float, tokens: int) -> float:
        # float32 weights and KV cache; ping-pong binds two KV copies
        copies = 1 if self.kv_binding == "in_place" else 2
        return param_count * 4.0 + copies * kv_bytes_per_token * tokens

    def matmul_weights(self) -> str | None:
        return self.weights


ENTRY = OrtEntry


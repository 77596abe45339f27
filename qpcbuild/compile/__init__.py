"""Compile backends: each turns a role's portable ONNX graph into its own compiled form.

Both sit behind one small interface so `bundle` never knows which one it is driving:
`check()` fails fast (before any export) when the backend cannot run here, and `build()`
writes the role's artifacts under the staging bundle and returns what the manifest records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..plan import BuildPlan, RolePlan


@dataclass(frozen=True)
class BuildContext:
    plan: BuildPlan
    staging: Path  # bundle root being assembled; every path in argv is relative to it
    emit_only: bool = False
    compiler: str | None = None


class Backend(Protocol):
    name: str

    def check(self, ctx: BuildContext) -> dict[str, Any]:
        """Raise ToolchainError when this backend cannot build here; else describe the toolchain."""

    def build(self, ctx: BuildContext, role: RolePlan, onnx_dir: Path) -> dict[str, Any]:
        """Write `<role>/...` artifacts into ctx.staging; return the manifest entry."""


def get_backend(name: str) -> Backend:
    if name == "onnxruntime":
        from .onnxruntime import OrtBackend
        return OrtBackend()
    if name == "qaic":
        from .qaic import QaicBackend
        return QaicBackend()
    raise ValueError(f"unknown backend '{name}'")

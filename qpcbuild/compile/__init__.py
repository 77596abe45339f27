"""Compile backends: each turns a role's portable ONNX graph into its own compiled form.

A backend is one module behind one interface, found by name in BACKENDS, so the bundle builder
and the unit planner never know which one they are driving:
- `check()` fails fast (before any export) when the backend cannot run here;
- `key_inputs()` is what its artifact's cache key is the digest of;
- `build_cached()` writes the role's artifacts under the staging bundle (from the cache when an
  entry exists) and returns the manifest entry that describes them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from ..cache import Cache
    from ..plan import BuildPlan, RolePlan

# name -> (module under qpcbuild.compile, class): a new backend is one module and one line here.
BACKENDS = {"onnxruntime": ("onnxruntime", "OrtBackend"), "qaic": ("qaic", "QaicBackend")}
DEFAULT_BACKEND = "onnxruntime"  # runs on any machine


@dataclass(frozen=True)
class BuildContext:
    plan: BuildPlan
    staging: Path  # bundle root being assembled; every path in argv is relative to it
    emit_only: bool = False
    compiler: str | None = None


class Backend(Protocol):
    name: str
    cache_kind: str  # the cache's folder for this backend's artifacts
    ships_graph: bool  # the bundle carries the portable ONNX graph (its artifact refers to it)

    def check(self, ctx: BuildContext) -> dict[str, Any]:
        """Raise ToolchainError when this backend cannot build here; else describe the toolchain."""

    def key_inputs(self, role: RolePlan, export_digest: str, tools: dict[str, Any],
                   compiler: str | None, emit_only: bool) -> dict[str, Any]:
        """What the role's artifact's cache key is the digest of."""

    def build_cached(self, ctx: BuildContext, role: RolePlan, cache: Cache, key: str,
                     inputs: dict[str, Any], onnx_dir: Callable[[], Path]) -> tuple[dict, bool]:
        """Put `<role>/...` artifacts into ctx.staging, from the cache or built; return (the
        manifest entry, whether the cache's entry was reused)."""


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend '{name}' ({' | '.join(BACKENDS)})")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()

"""What every backend's build (backends/<name>/build.py, BUILDER) implements for the bundle builder,
and the typed way to get one by name:
- `check()` fails fast (before any export) when the backend cannot run here;
- `key_inputs()` is what its artifact's cache key is the digest of;
- `build_cached()` writes the role's artifacts under the staging bundle (from the cache when an
  entry exists) and returns the manifest entry that describes them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union

from ..backend_api import backend_module

if TYPE_CHECKING:
    from ..cache import Cache, ScratchCache
    from ..delivered import DeliveredFiles
    from ..plan import BuildPlan, RolePlan


# The build's cache: a kept one, or --no-cache's scratch stand-in with the same methods.
BuildCache = Union["Cache", "ScratchCache"]


@dataclass(frozen=True)
class BuildContext:
    plan: BuildPlan
    staging: Path  # bundle root being assembled; every path in argv is relative to it
    emit_only: bool = False
    compiler: str | None = None
    # files the cache delivers into `staging` with the digests its entries recorded (the seal
    # does not read them again); None where nothing is sealed from them
    delivered: DeliveredFiles | None = None
    # the role's exported graph is a scratch copy and this backend its last reader (a build
    # without a cache): it may free the graph's bytes as it goes
    spend_export: bool = False


class Backend(Protocol):
    name: str
    cache_kind: str  # the cache's folder for this backend's artifacts
    ships_graph: bool  # the bundle carries the portable ONNX graph (its artifact refers to it)

    def check(self, ctx: BuildContext) -> dict[str, Any]:
        """Raise ToolchainError when this backend cannot build here; else describe the toolchain."""

    def runtime_problem(self) -> str | None:
        """Why this backend's sessions cannot run here (None: they can)."""

    def key_inputs(self, role: RolePlan, export_digest: str, tools: dict[str, Any],
                   compiler: str | None, emit_only: bool) -> dict[str, Any]:
        """What the role's artifact's cache key is the digest of."""

    def build_cached(self, ctx: BuildContext, role: RolePlan, cache: BuildCache, key: str,
                     inputs: dict[str, Any],
                     onnx_dir: Callable[[], Path]) -> tuple[dict[str, Any], bool]:
        """Put `<role>/...` artifacts into ctx.staging, from the cache or built; return (the
        manifest entry, whether the cache's entry was reused)."""


def get_backend(name: str) -> Backend:
    """The backend's builder, its module imported on first use."""
    builder: Backend = backend_module(name, "build").BUILDER()
    return builder

"""What the pipeline knows of backends without importing one: the backends by name, registered once
(BACKENDS), what each backend's planning returns (BackendPart) and implements (BackendPlan), and
what its manifest entry is (BackendEntry). Each backend is one folder, qpcbuild/backends/<name>/,
with the same modules, found here by that convention:

    plan.py      PLAN: its part of each role's BuildPlan, its cache key's settings, its warnings
    build.py     BUILDER: turns the role's ONNX graph into its artifact (bundle/backend.py, Backend)
    manifest.py  ENTRY: the pydantic model of its manifest entry (roles.<role>.backends.<name>)
    session.py   open_session: opens the artifact a bundle holds, for the runtime

This module sits below the plan and imports no backend: the plan, the manifest model, the bundle
builder and the loader ask it for a backend's module by name (backend_module), so a backend's
folder sits above all of them and the layers below never name one.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence

from pydantic import BaseModel, ConfigDict

from .errors import Problem
from .models.specialization import Specialization
from .recipe.schema import Recipe

if TYPE_CHECKING:  # (numpy with it: reading a manifest imports neither)
    from .models.arch import ArchSpec


# ---------------------------------------------------------------- the backends by name
@dataclass(frozen=True)
class BackendInfo:
    runs_on_host: bool  # runs on this machine's CPU (else on an accelerator card)
    cost_source: str  # what tune records as the source of call costs timed on it
    # --device for a bundle built for it in serve-config's legacy form (Qualcomm's vLLM 0.8.5
    # fork; vLLM 0.15 has no --device); also marks the backend vLLM serves
    vllm_device: str | None = None


# The one list of backends: a new backend is its folder and one line here.
BACKENDS: dict[str, BackendInfo] = {
    "onnxruntime": BackendInfo(runs_on_host=True, cost_source="onnxruntime-cpu"),
    "qaic": BackendInfo(runs_on_host=False, cost_source="qaic-card", vllm_device="qaic"),
}
DEFAULT_BACKEND = "onnxruntime"  # runs on any machine
HOST_BACKEND = DEFAULT_BACKEND  # what measuring builds for when the card is not the point


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def backend_info(name: str) -> BackendInfo:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend '{name}' ({' | '.join(BACKENDS)})")
    return BACKENDS[name]


def card_backend(names: Iterable[str]) -> str | None:
    """The first of `names` that runs on an accelerator card (None: all run on the host)."""
    return next((n for n in names if not backend_info(n).runs_on_host), None)


def vllm_backend() -> str:
    """The backend whose bundles vLLM serves (serve-config's hand-off)."""
    return next(n for n, info in BACKENDS.items() if info.vllm_device)


def backend_module(name: str, part: str) -> ModuleType:
    """One of the backend's modules (plan, build, manifest, session), imported now."""
    backend_info(name)  # an unknown name fails with the list of known ones
    return importlib.import_module(f"qpcbuild.backends.{name}.{part}")


# ---------------------------------------------------------------- planning
# The folder of a target's EAGLE-3 head compiled for a card, laid out as a role's (onnx/, qaic/,
# qpc/, logs/): the head is a unit of its own there, not a role of the manifest
EAGLE3_HEAD_UNIT = "target/eagle3"


def model_role(unit: str) -> str:
    """Whose model and graph a unit runs: a disaggregated bundle's "prefill" unit is the
    target's (its "target" and "draft" decode)."""
    return "target" if unit == "prefill" else unit


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output as declared: symbolic dims by name (batch_size, ctx_len...)."""
    name: str
    dtype: str  # "int64" | "float32"
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class DeclaredIO:
    """A role's graph inputs and outputs in graph order (models/graph_io.py declares them);
    the manifest records them as `io`."""
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, declared: Mapping[str, Sequence[Mapping[str, Any]]]) -> DeclaredIO:
        """From graph_io's {"inputs": [...], "outputs": [...]}."""
        def specs(side: str) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(e["name"], e["dtype"], tuple(e["shape"]))
                         for e in declared[side])
        return cls(inputs=specs("inputs"), outputs=specs("outputs"))

    def to_dict(self) -> dict[str, list[dict[str, Any]]]:
        """As the manifest and `qpcbuild plan --json` record it."""
        return {side: [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape)}
                       for e in getattr(self, side)] for side in ("inputs", "outputs")}


@dataclass(frozen=True)
class CacheKeys:
    """The settings part of each cache key of a role: its exported graph's, and each backend's
    artifact's (by backend name, in registry order)."""
    export: str
    backends: Mapping[str, str]

    def to_dict(self) -> dict[str, str]:
        return {"export": self.export, **self.backends}


@dataclass(frozen=True)
class RoleFacts:
    """What the plan decided for one role before any backend plans its artifact."""
    role: str  # the unit: "target" | "draft" | "prefill" (disaggregated; see model_role)
    cores: int  # per QID
    device_group: list[int]
    specializations: list[Specialization]
    io: DeclaredIO  # the exported graph's inputs and outputs
    export_key: str  # the settings part of the exported graph's cache key
    # A target's EAGLE-3 head compiled for a card beside it: the head's own unit (its folder
    # EAGLE3_HEAD_UNIT, its cores and devices, shapes and graph I/O); None: no such head
    head: RoleFacts | None = None

    @property
    def model_role(self) -> str:
        return model_role(self.role)


@dataclass(frozen=True)
class BackendPart:
    """A backend's part of one role's plan (each backend subclasses it with its fields)."""

    def to_dict(self) -> dict[str, Any]:
        """As `qpcbuild plan --json` shows it."""
        return asdict(self)

    def describe(self, r: Recipe, n_devices: int, built: bool) -> list[str]:
        """`qpcbuild plan`'s lines (rich markup) about this part; built: whether the recipe
        builds for this backend."""
        return []

    def manifest_role_fields(self) -> dict[str, Any]:
        """What the bundle's manifest records of this part beside the role's other fields
        (roles.<role>.<field>), for every role, whichever backends the bundle was built for."""
        return {}


class BackendPlan(Protocol):
    def plan_role(self, r: Recipe, facts: RoleFacts, compiler: str | None) -> BackendPart:
        """This backend's part of the role's plan (compiler: the --compiler option; a backend
        without a compiler ignores it)."""

    def settings(self, r: Recipe, facts: RoleFacts, part: Any) -> dict[str, Any]:
        """The settings part of the artifact's cache key (the plan digests it; the build adds
        the weights' content digest and the toolchain versions); part: what plan_role returned
        for the role."""

    def warnings(self, r: Recipe, configs: dict[str, dict[str, Any]]) -> list[str]:
        """What the plan warns about when the recipe builds for this backend (configs: each
        role's config.json)."""

    def problems(self, r: Recipe, role: str, arch: ArchSpec) -> list[Problem]:
        """What in the recipe this backend cannot build for the role's model (each a recipe
        key, the reason and the fix); the plan refuses the recipe with all of them."""


def backend_plan(name: str) -> BackendPlan:
    """The backend's planning."""
    plan: BackendPlan = backend_module(name, "plan").PLAN
    return plan


# ---------------------------------------------------------------- the manifest entry
class BackendEntry(BaseModel):
    # As the manifest's other parts: undeclared fields kept, values strictly typed, read-only.
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    status: str

    def problems(self, role: dict[str, Any]) -> list[str]:
        """What contradicts this entry in the rest of its role (role: the role's fields)."""
        return []

    def host_bytes(self, param_count: int, kv_bytes_per_token: float, tokens: int) -> float:
        """The host memory running this artifact takes (0: it runs elsewhere, on a card)."""
        return 0.0

    def matmul_weights(self) -> str | None:
        """The format of this artifact's matmul weights where the host runs it (float32 |
        int8 | int4); None where its formats are the card's own (the role's precision)."""
        return None

    def device_kv_buffers(self) -> list[str] | None:
        """The KV inputs' names in the artifact, where they are not the exported graph's (a
        disaggregated card unit's); None: the exported names."""
        return None

    def unit_graphs(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """Graphs of units compiled beside the role's own (a target's EAGLE-3 head on a card),
        by unit folder: (the graph's path in the bundle, its I/O as graph_io declares it)."""
        return {}


def entry_model(name: str) -> type[BackendEntry]:
    """The model of the backend's manifest entry."""
    model: type[BackendEntry] = backend_module(name, "manifest").ENTRY
    return model

"""Build units: the independent pieces of a bundle (each export, each backend artifact, each
QPC), with the cache keys that let separate machines build them into one shared cache and a
last `compile` assemble the bundle from hits. Units come exports first, so an index into the
list (a Kubernetes Indexed Job's JOB_COMPLETION_INDEX) picks the same unit everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cache import Cache
from .backend import Backend, get_backend
from ..errors import UsageError
from ..plan import BuildPlan, digest
from .keys import artifact_key_inputs, unit_name, weight_files


@dataclass(frozen=True)
class Unit:
    name: str
    stage: str  # export, or a backend's name
    role: str
    kind: str  # the cache kind it lands in
    key: str
    deps: tuple[str, ...]
    inputs: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "stage": self.stage, "role": self.role, "kind": self.kind,
                "key": self.key, "tag": f"{self.kind}-{self.key}", "deps": list(self.deps),
                "inputs": self.inputs}


def plan_units(plan: BuildPlan, cache: Cache, compiler: str | None = None) -> list[Unit]:
    """Every unit of the plan, keys computed as `compile` computes them (this reads the
    weights once to digest them; the digest is remembered per file state)."""
    cache.ensure_usable()
    backends: dict[str, Backend] = {name: get_backend(name) for name in plan.recipe.backends}
    exports: list[Unit] = []
    artifacts: list[Unit] = []
    for rp in plan.roles:
        ref = getattr(plan.recipe, rp.model_role)
        inputs = artifact_key_inputs(rp, cache.weights_digest(weight_files(rp, ref.allow_pickle)),
                                     backends, compiler)
        # (a disaggregated bundle's prefill unit compiles the target's one export)
        export = unit_name("export", rp.model_role)
        if all(u.name != export for u in exports):
            exports.append(Unit(export, "export", rp.model_role, "exports",
                                digest(inputs["export"]), (), inputs["export"]))
        artifacts += [Unit(unit_name(name, rp.role), name, rp.role, b.cache_kind,
                           digest(inputs[name]), (export,), inputs[name])
                      for name, b in backends.items()]
    return exports + artifacts


def select_unit(units: list[Unit], wanted: str) -> Unit:
    """A unit by name, or by its index in plan_units' order."""
    for n, unit in enumerate(units):
        if wanted in (unit.name, str(n)):
            return unit
    raise UsageError(f"--unit {wanted}: no such build unit; this recipe has "
                     + ", ".join(f"{n}={u.name}" for n, u in enumerate(units)))

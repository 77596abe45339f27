"""Build units: the independent pieces of a bundle (each export, each backend artifact, each
QPC), with the cache keys that let separate machines build them into one shared cache and a
last `compile` assemble the bundle from hits. Units come exports first, so an index into the
list (a Kubernetes Indexed Job's JOB_COMPLETION_INDEX) picks the same unit everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cache import Cache
from ..errors import UsageError
from ..plan import BuildPlan, digest, find_compiler
from .build import CACHE_KIND, artifact_key_inputs, unit_name, weight_files


@dataclass(frozen=True)
class Unit:
    name: str
    stage: str  # export | onnxruntime | qaic
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
    backends = list(plan.recipe.backends)
    path = find_compiler(compiler)[0] if "qaic" in backends else None
    exports, artifacts = [], []
    for rp in plan.roles:
        ref = getattr(plan.recipe, rp.role)
        inputs = artifact_key_inputs(rp, cache.weights_digest(weight_files(rp, ref.allow_pickle)),
                                     path)
        export = unit_name("export", rp.role)
        exports.append(Unit(export, "export", rp.role, "exports", digest(inputs["export"]), (),
                            inputs["export"]))
        artifacts += [Unit(unit_name(b, rp.role), b, rp.role, CACHE_KIND[b],
                           digest(inputs[b]), (export,), inputs[b]) for b in backends]
    return exports + artifacts


def select_unit(units: list[Unit], wanted: str) -> Unit:
    """A unit by name, or by its index in plan_units' order."""
    for n, unit in enumerate(units):
        if wanted in (unit.name, str(n)):
            return unit
    raise UsageError(f"--unit {wanted}: no such build unit; this recipe has "
                     + ", ".join(f"{n}={u.name}" for n, u in enumerate(units)))

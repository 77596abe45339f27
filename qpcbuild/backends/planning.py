"""What a backend's planning module implements, and what the plan hands it for each role."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..recipe import Recipe


@dataclass(frozen=True)
class RoleFacts:
    """What the plan decided for one role before any backend plans its artifact."""
    role: str  # "target" | "draft"
    cores: int  # per QID
    device_group: list[int]
    specializations: list[dict[str, Any]]  # named form: {"name": ..., "symbols": {...}}
    io: dict[str, list[dict[str, Any]]]  # the exported graph's inputs and outputs
    export_key: str  # the settings part of the exported graph's cache key


class BackendPlan(Protocol):
    def plan_role(self, r: Recipe, facts: RoleFacts, compiler: str | None) -> dict[str, Any]:
        """This backend's part of the role's plan: RolePlan fields by name, none of them
        planned by another backend (compiler: the --compiler option; a backend without a
        compiler ignores it)."""

    def settings(self, r: Recipe, facts: RoleFacts, planned: dict[str, Any]) -> dict[str, Any]:
        """The settings part of the artifact's cache key (the plan digests it; the build adds
        the weights' content digest and the toolchain versions); planned: what plan_role
        returned for the role."""

    def warnings(self, r: Recipe, configs: dict[str, dict[str, Any]]) -> list[str]:
        """What the plan warns about when the recipe builds for this backend (configs: each
        role's config.json)."""

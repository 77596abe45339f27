"""The cache keys of a build's artifacts: what each key is the digest of (the plan's settings,
the weights' content, the tools' versions), and the names of build units. The bundle builder
and the unit lister (units.py) both key the same artifacts with these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models.source import safetensors_files
from ..plan import EXPORTER_VERSION, RolePlan, digest
from ..recipe.schema import Draft, ModelRef, Recipe
from ..toolchain import artifact_versions
from ..version import __version__
from .backend import Backend


def artifact_key_inputs(role: RolePlan, weights_digest: str, backends: dict[str, Backend],
                        compiler: str | None = None,
                        emit_only: bool = False) -> dict[str, dict[str, Any]]:
    """What each artifact's cache key is the digest of: the plan's settings, the weights'
    content and the tools' versions (kept with the entry, so two keys can be compared)."""
    # (the export's digest is its key; the backends' keys include it)
    tools = artifact_versions()
    export = {"settings": role.cache_keys.export, "weights": weights_digest,
              "qpcbuild": __version__, "exporter": EXPORTER_VERSION,
              "onnx": tools["onnx"], "numpy": tools["numpy"]}
    return {"export": export,
            **{name: b.key_inputs(role, digest(export), tools, compiler, emit_only)
               for name, b in backends.items()}}


def model_ref(r: Recipe, role: RolePlan) -> ModelRef | Draft:
    """The recipe's entry for the role's model (the target's or the draft's)."""
    return r.target if role.model_role == "target" else r.draft


def weight_files(role: RolePlan, allow_pickle: bool) -> list[Path]:
    path = role.source.folder()
    return [*safetensors_files(path, allow_pickle), path / "config.json"]


def unit_name(stage: str, role: str) -> str:
    """A build unit: one stage (export | a backend) of one role, e.g. onnxruntime-draft."""
    return f"{stage}-{role}"

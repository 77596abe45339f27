"""BuildPlan -> bundle: export (cached), compile per backend, then one sealed manifest that
pairs the two roles and names every file with its SHA-256. The bundle appears complete or not
at all: it is assembled in a staging folder next to the output and renamed into place."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from ..cache import Cache, ScratchCache
from ..delivered import DeliveredFiles
from ..errors import UsageError
from ..models.source import resolve, tokenizer_files, weights_missing_message
from ..models.turbo_heads import TurboHeads, read_turbo_heads
from ..models.vocab_subset import read_vocab_subset, subset_digest
from ..plan import BuildPlan, RolePlan, digest
from ..progress import running
from ..recipe import recipe_relative
from ..recipe.schema import Recipe
from ..toolchain import artifact_versions
from ..tree import hash_tree
from .backend import Backend, BuildCache, BuildContext, get_backend
from .handoff import manifest_record
from .keys import artifact_key_inputs, model_ref, unit_name, weight_files
from .manifest import MANIFEST_SCHEMA, UNSEALED_FILES, Manifest, write_manifest
from .staging import (check_writable_parent, publish, refuse_to_replace, remove_debris,
                      staging_folder)

if TYPE_CHECKING:
    import numpy as np

SCRATCH = ".scratch"  # where a build without a cache makes its artifacts
# (stage, "reused" | "pulled" | "built", seconds); stages also say "from": local | remote | built
Progress = Callable[[str, str, float], None]


# compile --push: (staging with the sealed manifest, {file: where its bytes are}) -> pushed
Publish = Callable[[Path, dict[str, object]], dict[str, Any]]


@dataclass
class BuildResult:
    bundle: Path | None  # None: only build units were built (into the cache), or pushed
    bundle_id: str | None
    seconds: float
    stages: list[dict[str, Any]] = field(default_factory=list)
    pushed: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"bundle": self.bundle and str(self.bundle), "bundle_id": self.bundle_id,
                "seconds": round(self.seconds, 2), "stages": self.stages,
                **({"pushed": self.pushed} if self.pushed else {})}


def _check_output(out: Path) -> None:
    """Refuse an unusable output before any work is done."""
    refuse_to_replace(out)
    check_writable_parent(out, "-o")


# ---------------------------------------------------------------- the manifest
def _manifest(plan: BuildPlan, exports: dict[str, dict[str, Any]],
              backends: dict[str, dict[str, Any]], tools: dict[str, Any],
              files: dict[str, Any], extra: dict[str, Any]) -> Manifest:
    r = plan.recipe
    roles = {}
    for rp in plan.roles:
        src = rp.source
        roles[rp.role] = {
            "source": {"ref": src.recipe_ref, "revision": src.revision,
                       "origin": src.origin, "config_digest": src.config_digest,
                       "weights_digest": exports[rp.role]["weights_digest"],
                       "smoke_weights": bool(src.smoke_of)},
            "arch": rp.arch.to_dict(), "io": rp.io.to_dict(),
            "specializations": [s.model_dump() for s in rp.specializations],
            "num_cores": rp.num_cores,
            "device_group": rp.device_group,
            "precision": {"weights": r.precision.quantization, "kv_cache": r.precision.kv_cache_dtype,
                          "export_dtype": r.precision.export_dtype},
            # what each backend's plan part records beside the role's fields
            **{k: v for part in rp.backends.values()
               for k, v in part.manifest_role_fields().items()},
            "backends": {name: b[rp.role] for name, b in backends.items()},
        }
        if rp.vocab_subset:  # the ids live in the graph; the manifest says which set it was
            subset = rp.vocab_subset
            roles[rp.role]["vocab_subset"] = {"ref": subset.ref, "size": subset.size,
                                              "sha256": subset.sha256}
    raw = {
        "schema": MANIFEST_SCHEMA, "name": r.name,
        "speculation": {"method": plan.method, "options": plan.method_options,
                        "num_speculative_tokens": list(plan.ks), **runtime_speculation(r)},
        # (the tail windows only where the recipe has them: other bundles keep their ids)
        "shapes": r.shapes.model_dump(exclude=None if r.shapes.prefill_tail_seq_lens
                                      else {"prefill_tail_seq_lens"}),
        "hardware": r.hardware.model_dump(mode="json"),
        "backends": list(r.backends), "roles": roles,
        "tokenizer": {"files": "tokenizer/", **plan.tokenizer},
        "toolchain": tools,
        "files": files,
        **extra,
    }
    if r.disaggregated is not None:  # the units' placement and the KV hand-off contract
        raw["disaggregated"] = manifest_record(plan, exports["target"]["weights_digest"])
    return Manifest.unsealed(raw)


def runtime_speculation(r: Recipe) -> dict[str, Any]:
    """How the runtime speculates (docs/adaptive.md), where the recipe departs from the
    defaults (so bundles that do not keep their ids)."""
    sp = r.speculation
    out: dict[str, Any] = {}
    if sp.policy != "fixed":
        out["policy"] = sp.policy
    if sp.draft_p_min:
        out["draft_p_min"] = sp.draft_p_min
    if sp.num_speculative_tokens_per_batch_size:
        out["num_speculative_tokens_per_batch_size"] = {
            str(b): k for b, k in sorted(sp.num_speculative_tokens_per_batch_size.items())}
    return out


def _bundle_recipe(plan: BuildPlan) -> str:
    """The recipe as built, with each model named as the recipe named it (for smoke weights:
    the model they stand in for, not the cache path)."""
    data = plan.recipe.to_yaml_dict()
    for rp in plan.roles:
        data[rp.model_role]["model"] = rp.source.recipe_ref
    return yaml.safe_dump(data, sort_keys=False)


# ---------------------------------------------------------------- the build
def _require_weights(plan: BuildPlan) -> None:
    """A plan may stand on a known config alone; a build needs each model's files."""
    for rp in plan.roles:
        if rp.source.path is None:
            ref = getattr(plan.recipe, rp.model_role).model
            raise UsageError(f"{rp.role}.model: " + weights_missing_message(
                ref, rp.source.revision, recipe_relative(plan.recipe, ref),
                plan.recipe.source))


def _turbo_heads(role: RolePlan) -> TurboHeads | None:
    """The plan's turbo heads, read again and checked to be the ones the plan saw."""
    if role.turbo is None:
        return None
    heads = read_turbo_heads(Path(role.turbo.path), role.arch.hidden_size)
    if heads.info != role.turbo.info:
        raise UsageError(f"draft.model: {role.turbo.path} changed while the bundle was being "
                         "built")
    return heads


def _subset_ids(role: RolePlan) -> np.ndarray | None:
    """The plan's vocabulary subset, read again and checked to be the set the plan saw."""
    if not role.vocab_subset:
        return None
    ids = read_vocab_subset(Path(role.vocab_subset.path), role.arch.vocab_size,
                            role.arch.eos_token_ids)
    if subset_digest(ids) != role.vocab_subset.sha256:
        raise UsageError(f"draft.vocab_subset: {role.vocab_subset.path} changed while "
                         "the bundle was being built")
    return ids


@dataclass
class _Build:
    """One build's state across its steps: the cache keys and inputs per role, each role's
    export (made on first use), and the stages done so far."""
    plan: BuildPlan
    cache: BuildCache
    backends: dict[str, Backend]
    ctx: BuildContext
    units: set[str] | None
    say: Progress
    stages: list[dict[str, Any]] = field(default_factory=list)
    keys: dict[str, dict[str, str]] = field(default_factory=dict)
    inputs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    graphs: dict[str, tuple[Path, dict[str, Any]]] = field(default_factory=dict)
    onnx_dirs: dict[str, Callable[[], Path]] = field(default_factory=dict)
    shipped: dict[str, Path] = field(default_factory=dict)  # model role -> its graph in the bundle
    export_lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, stage: str, reused: bool, t0: float, origin: str) -> None:
        self.stages.append({"stage": stage, "reused": reused, "from": origin,
                            "seconds": round(time.perf_counter() - t0, 2)})
        self.say(stage, {"local": "reused", "remote": "pulled"}.get(origin, "built"),
                 time.perf_counter() - t0)

    def wanted(self, stage: str, role: str) -> bool:
        return self.units is None or unit_name(stage, role) in self.units

    def export(self, role: RolePlan) -> tuple[str, dict[str, Any]]:
        """The role's cache keys, and its export's record: from the cache's record alone where
        nothing built here needs the graph, else the export entry (from the cache or built)."""
        t0 = time.perf_counter()
        r, cache, backends = self.plan.recipe, self.cache, self.backends
        ref = model_ref(r, role)
        allow_pickle = ref.allow_pickle
        self.inputs[role.role] = inputs = artifact_key_inputs(
            role, cache.weights_digest(weight_files(role, allow_pickle)), backends,
            self.ctx.compiler, self.ctx.emit_only)
        self.keys[role.role] = keys = {stage: digest(i) for stage, i in inputs.items()}
        src = resolve(str(role.source.folder()), role.source.revision, allow_known=False)

        def build(tmp: Path) -> dict[str, Any]:
            from ..export import export_model  # onnx is imported only when a graph is built

            res = export_model(src, role.model_role, tmp / "onnx",
                               continuous_batching=r.shapes.full_batch_size is not None,
                               weight_dtype=r.precision.export_dtype, allow_pickle=allow_pickle,
                               allow_unused=ref.allow_unused_weights,
                               vocab_subset=_subset_ids(role), turbo=_turbo_heads(role),
                               eagle3=role.eagle3.read(role.arch) if role.eagle3 else None)
            return {"weights_digest": res.weights_digest, "metadata": res.metadata}

        key = keys["export"]

        def graph(t0: float = t0) -> tuple[Path, dict[str, Any]]:
            """The export entry, from the cache or built, on first use."""
            # by key: a disaggregated bundle's two target units share one export
            with self.export_lock:
                if key not in self.graphs:
                    entry, meta, reused = cache.get_or_build("exports", key, build,
                                                             inputs["export"])
                    entry = cache.materialize(entry)  # the graph's bytes are wanted here
                    self.record(f"export {role.model_role}", reused, t0,
                                cache.origin("exports", key, reused))
                    self.graphs[key] = entry, meta
            return self.graphs[key]

        self.onnx_dirs[role.role] = lambda: graph(time.perf_counter())[0] / "onnx"
        # When every artifact made from the graph is cached and the bundle does not carry
        # the graph, the entry's record is enough: a new runner does not fetch a graph it
        # would not use. A backend that must rebuild after all fetches it then.
        made = [(b.cache_kind, keys[name]) for name, b in backends.items()
                if self.wanted(name, role.role)]
        meta = None
        if made and not any(b.ships_graph for b in backends.values()) and \
                all(cache.has(*m) for m in made) and not cache.unread_problems("exports", key):
            meta = cache.record_meta("exports", key)
        if meta is None:
            return role.role, graph()[1]
        self.record(f"export {role.role}", True, t0, cache.origin("exports", key, True))
        return role.role, meta

    def build_artifacts(self, roles: list[RolePlan],
                        spent: bool = False) -> dict[str, dict[str, Any]]:
        """Each wanted backend's artifacts for each role, into the staging bundle; returns
        {backend: {role: its manifest entry}}. `spent`: the exports are removed afterwards."""
        staging, cache = self.ctx.staging, self.cache
        built: dict[str, dict[str, Any]] = {name: {} for name in self.backends}
        shipped = self.shipped  # across calls: role_by_role builds one role per call
        for rp in roles:
            todo = {name: b for name, b in self.backends.items() if self.wanted(name, rp.role)}
            ships = any(b.ships_graph for b in todo.values())
            # the last reader of a spent export frees it as it goes (never the bundle's copy)
            last = list(todo)[-1] if spent and todo and not ships else None
            if ships:  # every backend builds from it
                # (a disaggregated bundle's two target units share the target's one graph)
                onnx_dir = staging / rp.model_role / "onnx"
                if rp.model_role not in shipped:
                    cache.deliver(self.onnx_dirs[rp.role](), onnx_dir, known=self.ctx.delivered,
                                  copy=True)
                    shipped[rp.model_role] = onnx_dir
                self.onnx_dirs[rp.role] = partial(Path, onnx_dir)
            for name, backend in todo.items():
                t0 = time.perf_counter()
                key = self.keys[rp.role][name]
                with running(f"{name} {rp.role}"):  # minutes under qaic-compile
                    ctx = replace(self.ctx, spend_export=name == last)
                    info, reused = backend.build_cached(ctx, rp, cache, key,
                                                        self.inputs[rp.role][name],
                                                        self.onnx_dirs[rp.role])
                built[name][rp.role] = info
                self.record(f"{name} {rp.role}" + (" (emit only)" if info.get("status") ==
                                                   "emitted" else ""), reused, t0,
                            cache.origin(backend.cache_kind, key, reused))
        return built

    def role_by_role(self, roles: list[RolePlan]) -> tuple[dict[str, dict[str, Any]],
                                                          dict[str, dict[str, Any]]]:
        """Without a cache, smallest model first: each role exported, its artifacts built and
        moved into the bundle, then its export freed, before the next role's export starts.
        The disk holds one export beside the artifacts, the largest beside only the small
        roles' (a 1.5B float32 target's is ~7 GB). Returns what export/build_artifacts do."""
        assert not self.cache.keeps  # a kept cache's entries are not ours to free
        exports: dict[str, dict[str, Any]] = {}
        built: dict[str, dict[str, Any]] = {name: {} for name in self.backends}
        roles = sorted(roles, key=lambda rp: sum(f.stat().st_size for f in weight_files(
            rp, model_ref(self.plan.recipe, rp).allow_pickle)))
        for i, rp in enumerate(roles):
            role, exports[role] = self.export(rp)
            # a disaggregated bundle's target units share one export: kept for the later one
            spent = all(later.model_role != rp.model_role for later in roles[i + 1:])
            for name, entries in self.build_artifacts([rp], spent).items():
                built[name].update(entries)
            if spent:
                with self.export_lock:  # forgotten too: a later role with its key rebuilds it
                    entry = self.graphs.pop(self.keys[rp.role]["export"], None)
                if entry is not None:
                    shutil.rmtree(entry[0], ignore_errors=True)
        return exports, built


def _target_dir(plan: BuildPlan) -> Path:
    """The target's model folder, which must hold the tokenizer the bundle carries."""
    target = plan.target
    target_dir = target.source.folder()
    # Random smoke weights stand in for a model whose tokenizer is not on this machine.
    if not (target_dir / "tokenizer.json").is_file() and not target.source.smoke_of:
        raise UsageError(f"target.model: {target_dir} has no tokenizer.json; a bundle carries the "
                         "target's tokenizer (run and serve need it)")
    return target_dir


def _assemble_and_seal(run: _Build, out: Path, target_dir: Path,
                       exports: dict[str, dict[str, Any]],
                       built: dict[str, dict[str, Any]], tools: dict[str, Any],
                       manifest_extra: dict[str, Any]) -> Manifest:
    """Tokenizer and recipe next to the artifacts, every file hashed (what the cache delivered
    by its recorded digests), the manifest sealed over them."""
    staging = run.ctx.staging
    shutil.rmtree(staging / SCRATCH, ignore_errors=True)
    tok_dir = staging / "tokenizer"
    tok_dir.mkdir()
    for f in tokenizer_files(target_dir):
        shutil.copyfile(f, tok_dir / f.name)
    (staging / "recipe.yaml").write_text(_bundle_recipe(run.plan))
    # hashed by the cache already: not read again
    known = run.ctx.delivered.unchanged() if run.ctx.delivered else {}
    files = hash_tree(staging, exclude=[*UNSEALED_FILES, *known], what=f"hashing {out}")
    files = dict(sorted({**files, **known}.items()))
    return write_manifest(staging, _manifest(
        run.plan, exports, built, {**artifact_versions(), "backends": tools}, files,
        manifest_extra))


def build_bundle(plan: BuildPlan, *, cache: Cache | None, out: Path | None = None,
                 emit_only: bool = False, compiler: str | None = None, jobs: int = 1,
                 progress: Progress | None = None,
                 manifest_extra: dict[str, Any] | None = None,
                 units: set[str] | None = None, push: Publish | None = None) -> BuildResult:
    """`cache=None`: build everything afresh and move it into the bundle (`--no-cache`).
    `manifest_extra`: more top-level manifest keys (e.g. `tuning`, the evidence for K).
    `units`: build only these units (unit_name) into the cache, and no bundle.
    `push`: publish the sealed bundle with this instead of writing a folder at `out` (the
    staging folder still goes next to it); files the cache has are named, not copied, and
    the remote tier's are not downloaded unless something here reads them.
    Steps: check the toolchains -> export each role -> build each backend's artifacts ->
    assemble and seal -> publish."""
    start = time.perf_counter()
    r = plan.recipe
    out = Path(out) if out else r.output_dir()
    _require_weights(plan)
    backends: dict[str, Backend] = {name: get_backend(name) for name in r.backends}
    target_dir = _target_dir(plan)
    if push is None:
        _check_output(out)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    remove_debris(out)
    with staging_folder(out) as staging:
        store: BuildCache = cache or ScratchCache(staging / SCRATCH)
        store.ensure_usable()
        store.remove_debris()
        if push is not None:
            store.defer_remote_bytes()
        # what the cache put here (or, pushing, names), with checked digests
        delivered = DeliveredFiles(staging, by_reference=push is not None)
        ctx = BuildContext(plan, staging, emit_only, compiler, delivered)
        tools = {name: b.check(ctx) for name, b in backends.items()}  # fail before any export
        run = _Build(plan, store, backends, ctx, units, progress or (lambda *a: None))
        roles = [rp for rp in plan.roles
                 if any(run.wanted(stage, rp.role) for stage in ("export", *backends))]
        if store.keeps or units is not None:
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                exports = dict(pool.map(run.export, roles))
            built = run.build_artifacts(roles)
        else:  # --no-cache, where disk matters more than exporting the roles concurrently
            exports, built = run.role_by_role(roles)
        if units is not None:  # the units are in the cache; no bundle is assembled
            return BuildResult(None, None, time.perf_counter() - start, run.stages)
        manifest = _assemble_and_seal(run, out, target_dir, exports, built, tools,
                                      manifest_extra or {})
        if push is not None:
            pushed = push(staging, delivered.sources())
            return BuildResult(None, manifest.bundle_id, time.perf_counter() - start,
                               run.stages, pushed)
        publish(staging, out)
    return BuildResult(out, manifest.bundle_id, time.perf_counter() - start, run.stages)

"""BuildPlan -> bundle: export (cached), compile per backend, then one manifest that pairs the
two roles and names every file with its SHA-256. The bundle appears complete or not at all."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import yaml

from .archive import hash_tree
from .cache import Cache, link_tree
from .compile import BuildContext, get_backend
from .errors import BundleError
from .export import export_model
from .plan import BuildPlan, RolePlan
from .source import resolve, tokenizer_files
from .toolchain import versions

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = 1
Progress = Callable[[str, str, float], None]  # (stage, "reused" | "built" | "written", seconds)


@dataclass
class BuildResult:
    bundle: Path
    bundle_id: str
    seconds: float
    stages: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"bundle": str(self.bundle), "bundle_id": self.bundle_id,
                "seconds": round(self.seconds, 2), "stages": self.stages}


def bundle_id(files: dict[str, dict[str, Any]]) -> str:
    lines = "".join(f"{path}\0{meta['sha256']}\n" for path, meta in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def _export_role(plan: BuildPlan, role: RolePlan, cache: Cache) -> tuple[Path, dict, bool]:
    r = plan.recipe
    src = resolve(role.source["path"] or role.source["ref"], role.source["revision"],
                  allow_known=False)
    allow_pickle = (r.target if role.role == "target" else r.draft).allow_pickle

    def build(tmp: Path) -> dict[str, Any]:
        res = export_model(src, role.role, tmp / "onnx",
                           continuous_batching=r.shapes.full_batch_size is not None,
                           weight_dtype=r.precision.export_dtype, allow_pickle=allow_pickle)
        return {"weights_digest": res.weights_digest, "metadata": res.metadata}

    return cache.get_or_build("exports", role.cache_keys["export"], build)


def _manifest(plan: BuildPlan, exports: dict[str, dict], backends: dict[str, dict],
              toolchain: dict, files: dict, argv: list[str]) -> dict[str, Any]:
    r = plan.recipe
    roles = {}
    for rp in plan.roles:
        roles[rp.role] = {
            "source": {**rp.source, "weights_digest": exports[rp.role]["weights_digest"]},
            "arch": rp.arch.to_dict(), "io": rp.io, "specializations": rp.specializations,
            "compiled_ks": list(rp.ks), "num_cores": rp.num_cores,
            "device_group": rp.device_group,
            "precision": {"weights": r.precision.quantization, "kv_cache": r.precision.kv_cache_dtype,
                          "export_dtype": r.precision.export_dtype},
            "mdp_partition": rp.mdp_partition, "ort": rp.ort,
            "backends": {name: b[rp.role] for name, b in backends.items()},
        }
    return {
        "schema": MANIFEST_SCHEMA, "bundle_id": bundle_id(files), "name": r.name,
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "speculation": {"method": plan.method, "options": plan.method_options,
                        "num_speculative_tokens": list(plan.ks)},
        "shapes": r.shapes.model_dump(), "hardware": r.hardware.model_dump(mode="json"),
        "backends": list(r.backends), "roles": roles,
        "tokenizer": {"files": "tokenizer/", **plan.tokenizer},
        "toolchain": toolchain,
        "commands": {"qpcbuild": argv,
                     **{f"qaic_compile_{rp.role}": rp.compiler_argv for rp in plan.roles
                        if "qaic" in r.backends}},
        "files": files,
    }


def build_bundle(plan: BuildPlan, *, cache: Cache, out: Path | None = None, emit_only: bool = False,
                 compiler: str | None = None, jobs: int = 1, progress: Progress | None = None,
                 argv: list[str] | None = None,
                 manifest_extra: dict[str, Any] | None = None) -> BuildResult:
    """`manifest_extra`: more top-level manifest keys (e.g. `tuning`, the evidence for K)."""
    start = time.perf_counter()
    r = plan.recipe
    out = Path(out) if out else r.output_dir()
    say = progress or (lambda *a: None)
    stages: list[dict[str, Any]] = []

    def record(stage: str, reused: bool, t0: float) -> None:
        stages.append({"stage": stage, "reused": reused, "seconds": round(time.perf_counter() - t0, 2)})
        say(stage, "reused" if reused else "built", time.perf_counter() - t0)

    backends = {name: get_backend(name) for name in r.backends}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        ctx = BuildContext(plan, staging, emit_only, compiler)
        tool = {name: b.check(ctx) for name, b in backends.items()}  # fail before any export

        def export(role: RolePlan):
            t0 = time.perf_counter()
            entry, meta, reused = _export_role(plan, role, cache)
            record(f"export {role.role}", reused, t0)
            return role.role, (entry, meta)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            exports = dict(pool.map(export, plan.roles))

        built: dict[str, dict[str, Any]] = {name: {} for name in backends}
        for rp in plan.roles:
            onnx_dir = exports[rp.role][0] / "onnx"
            if "qaic" in backends:
                link_tree(onnx_dir, staging / rp.role / "onnx")
            for name, backend in backends.items():
                t0 = time.perf_counter()
                key = rp.cache_keys[name]
                if name == "onnxruntime":
                    def ort_build(tmp: Path, rp=rp, backend=backend) -> dict[str, Any]:
                        return backend.build(BuildContext(plan, tmp, emit_only, compiler), rp,
                                             onnx_dir)
                    entry, info, reused = cache.get_or_build("ort", key, ort_build)
                    link_tree(entry, staging)
                else:
                    reused = False
                    qpc_cache = cache.entry("qpc", key)
                    if not emit_only and (qpc_cache / "cache-entry.json").is_file():
                        backend.write_inputs(ctx, rp)
                        link_tree(qpc_cache, staging)
                        info = json.loads((qpc_cache / "cache-entry.json").read_text())
                        reused = True
                    else:
                        info = backend.build(ctx, rp, onnx_dir)
                        if info["status"] == "compiled":
                            # The compiler log is cached with the QPC: the manifest names it,
                            # so a bundle that reuses the QPC must carry it too.
                            cache.get_or_build("qpc", key, lambda tmp, rp=rp, info=info: (
                                link_tree(staging / rp.role / "qpc", tmp / rp.role / "qpc"),
                                link_tree(staging / rp.role / "logs", tmp / rp.role / "logs"),
                                info)[2])
                built[name][rp.role] = info
                record(f"{name} {rp.role}" + (" (emit only)" if name == "qaic" and emit_only
                                             else ""), reused, t0)

        target_src = plan.role("target").source
        tok_dir = staging / "tokenizer"
        tok_dir.mkdir()
        if target_src["path"]:
            for f in tokenizer_files(Path(target_src["path"])):
                shutil.copyfile(f, tok_dir / f.name)
        (staging / "recipe.yaml").write_text(yaml.safe_dump(r.to_yaml_dict(), sort_keys=False))
        files = hash_tree(staging, exclude=[MANIFEST])
        manifest = _manifest(plan, {k: v[1] for k, v in exports.items()}, built,
                             {**versions(), "backends": tool}, files, argv or sys.argv)
        manifest.update(manifest_extra or {})
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str) + "\n")
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return BuildResult(out, manifest["bundle_id"], time.perf_counter() - start, stages)


def _replace_dir(new: Path, out: Path) -> None:
    """Move the finished bundle into place; an older bundle at `out` is removed only after."""
    if out.exists():
        if not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise BundleError(f"{out} exists and is not a qpcbuild bundle; refusing to replace it")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, out)


# ---------------------------------------------------------------- reading bundles
def read_manifest(bundle: Path) -> dict[str, Any]:
    bundle = Path(bundle)
    path = bundle / MANIFEST
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a folder (a bundle is the folder `qpcbuild compile` "
                          "writes; use `qpcbuild unpack` for a .tar.gz)")
    if not path.is_file():
        raise BundleError(f"{bundle}: no {MANIFEST}; not a qpcbuild bundle")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: corrupted manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        raise BundleError(f"{path}: manifest schema {manifest.get('schema') if isinstance(manifest, dict) else '?'}"
                          f" is not supported (this qpcbuild reads schema {MANIFEST_SCHEMA})")
    return manifest


def verify_bundle(bundle: Path, fast: bool = False) -> list[str]:
    """Problems found (empty = intact). `fast` checks presence and sizes, not digests."""
    manifest = read_manifest(bundle)
    expected: dict[str, dict] = manifest.get("files", {})
    problems = []
    try:
        if fast:
            actual = {p.relative_to(bundle).as_posix(): {"size": p.stat().st_size}
                      for p in Path(bundle).rglob("*") if p.is_file()}
            actual.pop(MANIFEST, None)
        else:
            actual = hash_tree(Path(bundle), exclude=[MANIFEST])
    except Exception as exc:  # a link or special file inside the bundle
        return [str(exc)]
    for path, meta in sorted(expected.items()):
        got = actual.get(path)
        if got is None:
            problems.append(f"missing file: {path}")
        elif got["size"] != meta["size"]:
            problems.append(f"changed file: {path} (size {got['size']}, manifest {meta['size']})")
        elif not fast and got["sha256"] != meta["sha256"]:
            problems.append(f"changed file: {path} (sha256 differs from the manifest)")
    for path in sorted(set(actual) - set(expected)):
        problems.append(f"extra file: {path}")
    if not fast and bundle_id(expected) != manifest.get("bundle_id"):
        problems.append("manifest: bundle_id does not match its file list")
    return problems

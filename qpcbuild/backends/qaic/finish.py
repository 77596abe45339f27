"""Adopt QPCs compiled on the SDK machine into an --emit-only bundle and re-seal it.

The hand-off is: `qpcbuild compile --emit-only` here, `bash <role>/qaic/compile.sh` on a
machine with the Cloud AI SDK (it ends by calling `qpcbuild finish` when qpcbuild is on PATH),
then the bundle verifies, runs and serves with its QPCs like one compiled in a single step.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ...bundle.manifest import Manifest, SealedManifest, write_manifest
from ...bundle.verify import actual_files, compare_files
from ...errors import BundleError, QpcbuildError, UsageError
from ...toolchain import compiler_identity, qaic_sdk_versions
from ...version import __version__
from .manifest import ADOPTED, NAME, QPC_FILE, QaicEntry, compiled_units


def _under(path: str, folders: tuple[str, ...]) -> bool:
    return any(path.startswith(f"{folder}/") for folder in folders)


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def finish_bundle(bundle: Path, roles: list[str] | None = None,
                  compiler: str | None = None) -> Manifest:
    """Record each role's QPC (files, digests, log, SDK versions), mark it compiled, re-seal.
    Returns the new manifest. Finishes of one bundle take turns (two compile.sh run at once,
    one per role, each end in a finish): each reads the manifest the other wrote."""
    bundle = Path(bundle)
    compiler_id = compiler_identity(compiler) if compiler else None  # a bad path fails first
    with _locked(bundle):
        return _finish(bundle, roles, compiler_id)


@contextmanager
def _locked(bundle: Path) -> Iterator[None]:
    """An exclusive lock on the bundle folder itself, so nothing is written into the bundle or
    beside it for it; released when the process dies."""
    try:
        fd = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise UsageError(f"{bundle}: not a bundle folder ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _finish(bundle: Path, roles: list[str] | None,
            compiler_id: dict[str, str] | None) -> Manifest:
    sealed = SealedManifest(bundle)
    m = sealed.checked()
    qaic: dict[str, QaicEntry] = {r: e for r, info in m.roles.items()
                                  if (e := info.built(QaicEntry)) is not None}
    qaic_roles = list(qaic)
    if not qaic_roles:
        raise UsageError(f"{bundle}: not built for the qaic backend; there is no QPC to finish")
    roles = roles or qaic_roles
    for role in roles:
        if role not in qaic_roles:
            raise UsageError(f"--role {role}: this bundle has qaic inputs for "
                             f"{', '.join(qaic_roles)} only")
    # Another role whose QPC compile.sh wrote but no finish recorded (qpcbuild was not on the
    # SDK machine's PATH, or its own finish has not run yet) is adopted too: left out, its QPC
    # would be an unsealed extra file in a bundle `verify` rejects. Its own finish, when it
    # runs, hashes it again. An unfinished role without a QPC stays out of this manifest.
    unfinished = [r for r in qaic_roles if r not in roles and qaic[r].status != "compiled"]
    roles = list(roles) + [r for r in unfinished if _nonempty(bundle / r / "qpc" / QPC_FILE)]
    adopting = tuple(f"{unit}/{part}" for role in roles
                     for unit in compiled_units(role, qaic[role].eagle3_head) for part in ADOPTED)
    pending = tuple(f"{unit}/{part}" for role in unfinished if role not in roles
                    for unit in compiled_units(role, qaic[role].eagle3_head) for part in ADOPTED)
    # Every sealed file is hashed, not only sized: a byte flipped in a graph or the compiler's
    # inputs after `compile --emit-only` must not be sealed anew beside a QPC built from it. A
    # QPC compiled again replaces the one recorded before.
    try:
        found = actual_files(bundle, fast=False)
    except (OSError, QpcbuildError) as exc:  # a link or special file inside the bundle
        raise BundleError(f"{bundle} cannot be finished: {exc}") from None
    problems = [p for p in sealed.changed_fields() + compare_files(sealed.files, found,
                                                                   adopting=adopting + pending)
                if not any(f": {folder}/" in p for folder in adopting)]
    if problems:
        raise BundleError(f"{bundle} does not match its manifest, so it cannot be finished: "
                          + "; ".join(problems[:5]))
    for role in roles:
        for unit in compiled_units(role, qaic[role].eagle3_head):
            qpc = bundle / unit / "qpc" / QPC_FILE
            if not _nonempty(qpc):
                state = "is empty" if qpc.is_file() else "is missing"
                what = role if unit == role else f"{role}'s EAGLE-3 head"
                raise BundleError(f"the {what} QPC {state} ({unit}/qpc/{QPC_FILE}); run "
                                  f"`bash {role}/qaic/compile.sh` in the bundle on a machine "
                                  "with the Cloud AI SDK first")
    files = {p: meta if _under(p, adopting) else sealed.files[p] for p, meta in found.items()
             if not _under(p, pending)}
    sdk = qaic_sdk_versions()
    entries = {role: {**_compiled(role, files), "compiler": compiler_id,
                      "sdk": sdk, "finished_by": f"qpcbuild {__version__}"} for role in roles}
    for role in roles:
        head = qaic[role].eagle3_head
        if head is not None:
            entries[role]["eagle3_head"] = {**head.model_dump(mode="json"),
                                            **_compiled(head.unit, files)}
    return write_manifest(bundle, m.with_built(NAME, entries, files,
                                               {} if sdk is None else {"qaic_sdk": sdk}))


def _compiled(unit: str, files: dict[str, Any]) -> dict[str, Any]:
    """A unit's record of its QPC once compiled: its files and log, as found in the bundle."""
    return {"status": "compiled", "qpc": f"{unit}/qpc",
            "qpc_files": sorted(p for p in files if p.startswith(f"{unit}/qpc/")),
            "log": log if (log := f"{unit}/logs/qaic-compile.log") in files else None}

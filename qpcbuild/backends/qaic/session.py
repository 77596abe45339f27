"""How the runtime opens a role's QPC on a Cloud AI card (the session class is the runtime's,
runtime/qaic_session.py): the loader finds this through the registry."""

from __future__ import annotations

from pathlib import Path

from ...bundle.manifest import Manifest
from ...errors import BundleError
from ...runtime.qaic_session import QaicSession
from ...runtime.model_session import Specialization
from ...backend_api import DEFAULT_BACKEND
from .manifest import QaicEntry


def open_session(bundle: Path, manifest: Manifest, role: str, entry: QaicEntry) -> QaicSession:
    info = manifest.roles[role]
    if entry.status != "compiled" or entry.qpc is None:
        raise BundleError(f"{bundle}: the {role} QPC was not compiled (status "
                          f"{entry.status}); on a machine with the Cloud AI SDK run "
                          f"`bash {role}/qaic/compile.sh` in the bundle (it ends with "
                          f"`qpcbuild finish`), or use --backend {DEFAULT_BACKEND}")
    return QaicSession(bundle / entry.qpc, role,
                       [Specialization.from_manifest(s) for s in info.specializations],
                       info.device_group, info.arch.num_layers, info.arch.vocab_size)

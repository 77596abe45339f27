"""Versions of everything that shaped a build, recorded in every manifest."""

from __future__ import annotations

import os
import platform
import re
import shutil
import stat
from importlib import metadata
from pathlib import Path

from .version import __version__

SDK_VERSION_FILES = ("/opt/qti-aic/versions/apps.xml", "/opt/qti-aic/versions/platform.xml")


HOST_RUNTIME = "onnxruntime"  # the package the host backend runs on (bench records its version)


def package_version(name: str) -> str | None:
    """An installed distribution's version (None: not installed)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def qaic_sdk_versions(files=SDK_VERSION_FILES) -> dict[str, str] | None:
    """Apps/platform SDK versions from the SDK's XML files; None when the SDK is absent."""
    found = {}
    for f in map(Path, files):
        if f.is_file():
            text = f.read_text(errors="replace")
            # The files carry <base_version>1.x.y</base_version> and <build_id>...</build_id>.
            parts = [m.group(1) for tag in ("base_version", "build_id")
                     for m in [re.search(rf"<{tag}>\s*([^<]+?)\s*</{tag}>", text)] if m]
            found[f.stem] = ".".join(parts) if parts else text.strip()[:200]
    return found or None


def artifact_versions() -> dict[str, object]:
    """The versions that shape a bundle's artifacts: recorded in the manifest (and so in the
    bundle id) and in the cache keys. Tools that only run the build (Python, transformers)
    are left out, so two machines with the same toolchain build the same bundle."""
    return {"qpcbuild": __version__, "onnx": package_version("onnx"),
            "onnxruntime": package_version("onnxruntime"),
            "numpy": package_version("numpy"), "qaic_sdk": qaic_sdk_versions()}


def executable(name: str) -> str:
    """The program `name` names, as a shell would run it: a bare name is looked up on PATH, a
    path is taken as given. Raises UsageError saying why it cannot be the compiler (missing, a
    folder, a device such as /dev/zero, not executable)."""
    from .errors import UsageError

    found = shutil.which(name) if os.sep not in name else name
    if found is None:
        raise UsageError(f"compiler '{name}' is not on PATH; give its full path")
    try:
        mode = os.stat(found).st_mode
    except OSError as exc:
        raise UsageError(f"compiler '{name}': {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise UsageError(f"compiler '{name}' is {kind}; give the qaic-compile program")
    if not os.access(found, os.X_OK):
        raise UsageError(f"compiler '{name}' is not executable (chmod +x it)")
    return os.path.abspath(found)


def compiler_identity(path: str | None) -> dict[str, str] | None:
    """The Qualcomm compiler by name and content, not by where it is installed."""
    if not path:
        return None
    from .tree import file_digest

    found = executable(path)
    return {"name": Path(found).name, "sha256": file_digest(Path(found))}


def versions() -> dict[str, object]:
    return {"qpcbuild": __version__, "python": platform.python_version(),
            "onnx": package_version("onnx"), "onnxruntime": package_version("onnxruntime"),
            "transformers": package_version("transformers"), "tokenizers": package_version("tokenizers"),
            "numpy": package_version("numpy"), "qaic_sdk": qaic_sdk_versions()}

"""Bundles: build (build.py), the sealed manifest (manifest.py), verify (verify.py) and archives
(archive.py). (The SDK hand-off, `finish`, is the qaic backend's: backends/qaic/finish.py.)

Names are imported when first used: building pulls in the exporter (onnx, numpy), which
`inspect` or `verify` should not pay for at start-up."""

from importlib import import_module
from typing import Any

_WHERE = {"BuildResult": "build", "build_bundle": "build",
          "MANIFEST": "manifest", "read_manifest": "manifest", "verify_bundle": "verify"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)

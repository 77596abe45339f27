"""The backends by name: a new backend is one module under qpcbuild.compile and one line in
BACKENDS. Readers that only need the names (the loader, serve) import this module, not the build
interface (compile/__init__.py), so knowing the names costs no import of the plan."""

from __future__ import annotations

import importlib

# name -> (module under qpcbuild.compile, class)
BACKENDS = {"onnxruntime": ("onnxruntime", "OrtBackend"), "qaic": ("qaic", "QaicBackend")}
DEFAULT_BACKEND = "onnxruntime"  # runs on any machine


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def get_backend(name: str):
    """The backend (a compile.Backend) called `name`; its module is imported on first use."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend '{name}' ({' | '.join(BACKENDS)})")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(f"qpcbuild.compile.{module}"), cls)()

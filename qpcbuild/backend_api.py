"""The backends by name: a new backend is one module under qpcbuild.compile and one line in
BACKENDS. Readers that only need the names or a backend's static facts (the loader, serve,
measuring, tune) import this module, not the build interface (compile/__init__.py), so knowing
them costs no import of the plan."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class BackendInfo:
    module: str  # under qpcbuild.compile
    cls: str
    runs_on_host: bool  # runs on this machine's CPU (else on an accelerator card)
    cost_source: str  # what tune records as the source of call costs timed on it
    # --device for a bundle built for it in serve-config's legacy form (Qualcomm's vLLM 0.8.5
    # fork; vLLM 0.15 has no --device); also marks the backend vLLM serves
    vllm_device: str | None = None


BACKENDS = {
    "onnxruntime": BackendInfo("onnxruntime", "OrtBackend", runs_on_host=True,
                               cost_source="onnxruntime-cpu"),
    "qaic": BackendInfo("qaic", "QaicBackend", runs_on_host=False, cost_source="qaic-card",
                        vllm_device="qaic"),
}
DEFAULT_BACKEND = "onnxruntime"  # runs on any machine
HOST_BACKEND = DEFAULT_BACKEND  # what measuring builds for when the card is not the point


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def backend_info(name: str) -> BackendInfo:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend '{name}' ({' | '.join(BACKENDS)})")
    return BACKENDS[name]


def card_backend(names) -> str | None:
    """The first of `names` that runs on an accelerator card (None: all run on the host)."""
    return next((n for n in names if not backend_info(n).runs_on_host), None)


def vllm_backend() -> str:
    """The backend whose bundles vLLM serves (serve-config's hand-off)."""
    return next(n for n, info in BACKENDS.items() if info.vllm_device)


def get_backend(name: str):
    """The backend (a compile.Backend) called `name`; its module is imported on first use."""
    info = backend_info(name)
    return getattr(importlib.import_module(f"qpcbuild.compile.{info.module}"), info.cls)()

"""`qpcbuild serve`: an OpenAI-compatible smoke server on a bundle (ONNX Runtime, or qaicrt on a
card), so the client tests and dashboards written for vLLM run before any card is involved."""

from __future__ import annotations

from pathlib import Path

from ..backend_api import DEFAULT_BACKEND

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def serve(bundle: Path, host: str = "127.0.0.1", port: int = 8000, backend: str = DEFAULT_BACKEND,
          verify: str = "full", model_name: str | None = None, log_level: str = "info",
          **load_options) -> None:
    """Checks the arguments and takes the port before the (slow) bundle load, so a typo or a busy
    port fails in a second, not after the model is loaded."""
    from ..errors import UsageError
    from .http import listen, run_until_signalled

    if log_level not in LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}")
    sock = listen(host, port)
    try:
        from ..runtime.loader import load
        from .app import build_app

        gen = load(bundle, backend=backend, verify=verify, **load_options)
        run_until_signalled(build_app(gen, model_name or gen.manifest.name), sock, log_level)
    finally:
        sock.close()

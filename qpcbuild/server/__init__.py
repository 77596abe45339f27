"""`qpcbuild serve`: an OpenAI-compatible smoke server on a bundle (ONNX Runtime, or qaicrt on a
card), so the client tests and dashboards written for vLLM run before any card is involved."""

from __future__ import annotations

from pathlib import Path

from ..backend_api import DEFAULT_BACKEND

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def serve(bundle: Path, host: str = "127.0.0.1", port: int = 8000, backend: str = DEFAULT_BACKEND,
          verify: str = "full", model_name: str | None = None, log_level: str = "info",
          quiet: bool = False, stats_interval: float = 10.0,
          prefill_timeout: float | None = None, **load_options) -> None:
    """Checks the arguments and takes the port before the (slow) bundle load, so a typo or a busy
    port fails in a second, not after the model is loaded. quiet: no line per request and no
    throughput lines (a log level above info has the same effect). prefill_timeout: seconds
    after which a disaggregated bundle's silent prefill worker counts as hung."""
    import math

    from ..errors import UsageError
    from .access import ServerLog
    from .http import listen, run_until_signalled

    if log_level not in LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}")
    if not (math.isfinite(stats_interval) and stats_interval >= 0):
        raise UsageError(f"--stats-interval must be a number of seconds >= 0 (0: none); got "
                         f"{stats_interval}")
    if prefill_timeout is not None and not (math.isfinite(prefill_timeout) and
                                            prefill_timeout > 0):
        raise UsageError(f"--prefill-timeout must be a number of seconds > 0; got "
                         f"{prefill_timeout}")
    sock = listen(host, port)
    try:
        from ..runtime.loader import load
        from .app import build_app

        gen = load(bundle, backend=backend, verify=verify, **load_options)
        if prefill_timeout is not None and gen.prefill_worker is not None:
            gen.prefill_worker.reply_timeout_s = prefill_timeout
        name = model_name or gen.manifest.name
        talk = not quiet and LOG_LEVELS.index(log_level) >= LOG_LEVELS.index("info")
        log = ServerLog(requests=talk, stats_interval=stats_interval if talk else 0)
        port = sock.getsockname()[1]
        log.say(f"serving '{name}' at {base_url(host, port)} (OpenAI API; also /health and "
                "/metrics); Ctrl-C stops")
        note = gen.manifest.target_weights_label()
        if note and gen.backend == backend == DEFAULT_BACKEND:
            log.say(note)
        run_until_signalled(build_app(gen, name, log), sock, log_level)
    finally:
        sock.close()


def base_url(host: str, port: int) -> str:
    """The URL a client on this machine points its OpenAI client at."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{shown}]:{port}/v1" if ":" in shown else f"http://{shown}:{port}/v1"

"""`qpcbuild serve`: an OpenAI-compatible smoke server on a bundle (ONNX Runtime, or qaicrt on a
card), so the client tests and dashboards written for vLLM run before any card is involved."""

from __future__ import annotations

from pathlib import Path


def serve(bundle: Path, host: str = "127.0.0.1", port: int = 8000, backend: str = "onnxruntime",
          verify: str = "full", model_name: str | None = None, log_level: str = "info",
          spec_policy: str | None = None) -> None:
    import uvicorn

    from ..runtime.loader import load
    from .app import build_app

    gen = load(bundle, backend=backend, verify=verify, spec_policy=spec_policy)
    app = build_app(gen, model_name or gen.manifest["name"])
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)

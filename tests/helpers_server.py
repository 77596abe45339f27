"""`qpcbuild serve` in the test process, and what it serves: a free loopback port, the demo
bundle built with overrides, the demo prompts, and a live server on a thread with the real
`openai` client pointed at it. Shared by test_server.py, test_server_speculation.py,
test_server_hardening.py and test_signatures.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import qpcbuild
from qpcbuild.cli import app
from qpcbuild.server.app import build_app

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
_EVAL = [json.loads(line)["text"]
         for line in (DEMO / "eval_prompts.jsonl").read_text().splitlines()]
PROMPTS = (_EVAL + [t[:len(t) // 2] for t in _EVAL])[:32]  # 32 distinct prompts
runner = CliRunner()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, bundle: Path):
        self.gen = qpcbuild.load(bundle, verify="none")
        self.name = self.gen.manifest.name
        self.port = free_port()
        config = uvicorn.Config(build_app(self.gen, self.name), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(self.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def build(tmp: Path, *overrides: str, target: Path | None = None) -> Path:
    """The demo bundle under tmp/bundle, with `--set` overrides, or with `target` as the target
    model (and the demo draft), sharing one compile cache beside tmp."""
    argv = ["compile", str(ROOT / "recipes" / "demo.yaml"), "-o", str(tmp / "bundle"),
            "--cache-dir", str(tmp.parent / "server-cache")]
    for o in overrides:
        argv += ["--set", o]
    if target:
        argv += ["--set", f"target.model={target}", "--set", f"draft.model={DEMO / 'draft'}"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    return tmp / "bundle"

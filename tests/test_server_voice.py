"""What `qpcbuild serve` says, to its clients and in its log (issue 48): errors in HTTP's terms
(the request's field, the client's own route, never a CLI flag or a server path), the URL at
start-up, one line per request, periodic throughput and acceptance, and a flag to quiet it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers_server import ROOT, LiveServer, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(demo_build):
    s = LiveServer(demo_build[0])  # the demo target ships no chat template
    yield s
    s.stop()


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert "Traceback" not in r.text and "<server path>" not in err["message"]
    return err


# ---------------------------------------------------------------- 9: HTTP errors speak HTTP
def test_chat_without_a_template_names_the_field_and_the_route_not_a_cli_flag(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": server.name, "messages": [{"role": "user", "content": "hi"}]})
    err = error_of(r, 400)
    assert "--chat" not in err["message"] and "tokenizer" not in err["message"]
    assert err["param"] == "messages"
    assert "/v1/completions" in err["message"] and "`prompt`" in err["message"]


@pytest.mark.parametrize("method, route, status, needle", [
    ("GET", "/nope", 404, "GET /nope: not found"),
    ("GET", "/v1/chat/completion", 404, "GET /v1/chat/completion: not found"),
    ("GET", "/v1/completions", 405, "GET /v1/completions: method not allowed (this route "
                                    "takes POST)"),
    ("POST", "/v1/models", 405, "POST /v1/models: method not allowed"),
])
def test_an_unknown_route_is_named_as_the_client_sent_it(server, method, route, status, needle):
    err = error_of(httpx.request(method, server.url + route, timeout=30), status)
    assert err["message"].startswith(needle), err["message"]
    if status == 404:
        assert "/v1/completions" in err["message"]  # the routes that exist


def test_an_empty_prompt_is_a_400_naming_the_field(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": server.name, "prompt": "", "max_tokens": 2})
    err = error_of(r, 400)
    assert err["param"] == "prompt"


# ---------------------------------------------------------------- 5: the server's own log
class Served:
    """`qpcbuild serve` as a process, its log in a file."""

    def __init__(self, bundle: Path, log: Path, *extra: str):
        self.port, self.log = free_port(), log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qpcbuild", "serve", str(bundle), "--port", str(self.port),
             "--verify", "none", *extra], stdout=subprocess.DEVNULL, stderr=log.open("w"),
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.url = f"http://127.0.0.1:{self.port}"
        self.wait_for(lambda: httpx.get(self.url + "/health", timeout=1).status_code == 200)

    def wait_for(self, ready, seconds: float = 60.0) -> None:
        deadline = time.time() + seconds
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, self.log.read_text()
            time.sleep(0.1)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        return self.log.read_text()


def test_serve_says_its_url_logs_each_request_and_reports_throughput(demo_build, tmp_path):
    s = Served(demo_build[0], tmp_path / "log", "--stats-interval", "0.5")
    try:
        assert f"at http://127.0.0.1:{s.port}/v1 " in s.log.read_text()
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"model": "demo", "prompt": "def fib", "max_tokens": 8})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        httpx.get(s.url + "/no/such/route", timeout=10)
        s.wait_for(lambda: "GET /no/such/route 404" in s.log.read_text()
                   and "throughput:" in s.log.read_text(), 20)
    finally:
        log = s.stop()
    said = f"POST /v1/completions 200, {usage['prompt_tokens']} prompt + " \
        f"{usage['completion_tokens']} generated tokens, "
    assert said in log, log
    stats = next(line for line in log.splitlines() if "throughput:" in line)
    assert re.search(r"generation [1-9][\d.]* tokens/s", stats), stats
    assert re.search(r"draft acceptance [\d.]+%, mean acceptance length [\d.]+", stats), stats
    assert "Traceback" not in log


def test_serve_quiet_keeps_only_the_start_up_line(demo_build, tmp_path):
    s = Served(demo_build[0], tmp_path / "log", "--quiet", "--stats-interval", "0.2")
    try:
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"model": "demo", "prompt": "def fib", "max_tokens": 4})
        assert r.status_code == 200, r.text
        time.sleep(0.6)  # three stats intervals
    finally:
        log = s.stop()
    assert f"http://127.0.0.1:{s.port}/v1" in log
    assert "POST /v1/completions" not in log and "throughput:" not in log, log


# ---------------------------------------------------------------- 3: a decode heard in a log
def test_run_in_a_log_says_how_far_decoding_is_while_it_runs(demo_build, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def fib\nclass Tree\nimport os\n")
    done = subprocess.run(
        [sys.executable, "-m", "qpcbuild", "run", str(demo_build[0]), "--prompt-file",
         str(prompts), "--max-new-tokens", "64", "--verify", "none", "--compare-baseline"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "QPCBUILD_PROGRESS_INTERVAL": "0.01"})
    assert done.returncode == 0, done.stderr
    running = [line for line in done.stderr.splitlines() if line.endswith("s so far")]
    assert running, done.stderr
    assert re.match(r"decoding \S+ \(and target-only\): [\d,]+ tokens of 384 tokens \(\d+%\)",
                    running[0]), running[0]
    assert re.search(r"decoding \S+ \(and target-only\): [\d,]+ tokens in [\d.]+ s "
                     r"\([\d,.]+ tokens/s\)", done.stderr), done.stderr  # 1,325 tokens/s

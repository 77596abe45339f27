"""What `qpcbuild serve` says, to its clients and in its log (issue 48): errors in HTTP's terms
(the request's field, the client's own route, never a CLI flag or a server path), the URL at
start-up, one line per request, periodic throughput and acceptance, and a flag to quiet it."""

from __future__ import annotations

import httpx
import pytest

from helpers_server import LiveServer

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

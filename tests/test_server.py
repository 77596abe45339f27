"""`qpcbuild serve` driven by the real `openai` client (and httpx for raw streams): every answer
must be the tokens `run` gives for the same prompt, every bad request an OpenAI-style error, and
/metrics (parsed by prometheus_client) must add up to the requests' own statistics."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from helpers_server import DEMO, PROMPTS, LiveServer, build

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """Batch 1 (requests queue), the demo target given a ChatML template."""
    tmp = tmp_path_factory.mktemp("chat")
    target = tmp / "target"
    shutil.copytree(DEMO / "target", target)
    (target / "chat_template.jinja").write_text(CHATML)
    server = LiveServer(build(tmp, target=target))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cb_server(tmp_path_factory):
    """Four KV slots: concurrent requests share the engine by continuous batching."""
    server = LiveServer(build(tmp_path_factory.mktemp("cb"), "shapes.full_batch_size=4"))
    yield server
    server.stop()


def run_tokens(gen, prompt, n: int, chat: bool = False) -> list[int]:
    row = gen.generate([prompt], max_new_tokens=n, chat=chat).rows[0]
    return row.tokens[len(row.prompt):]


def text_of(gen, ids: list[int]) -> str:
    return gen.tokenizer.decode(ids)


def test_completion_equals_run(chat_server):
    s = chat_server
    for prompt in PROMPTS[:3]:
        out = s.client.completions.create(model=s.name, prompt=prompt, max_tokens=24,
                                          temperature=0)
        want = run_tokens(s.gen, prompt, 24)
        assert out.choices[0].text == text_of(s.gen, want)
        assert out.usage.completion_tokens == len(want)
        assert out.usage.prompt_tokens == len(s.gen.encode(prompt))
        assert out.choices[0].finish_reason in ("length", "stop")


def test_chat_completion_uses_the_bundles_template_and_equals_run_chat(chat_server):
    s = chat_server
    question = "def parse(line):"
    out = s.client.chat.completions.create(model=s.name, temperature=0, max_tokens=20,
                                           messages=[{"role": "user", "content": question}])
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text_of(s.gen, run_tokens(s.gen, question, 20,
                                                                       chat=True))
    assert out.usage.prompt_tokens == len(s.gen.chat_prompt(question))


def test_streamed_completion_is_the_same_text_in_pieces(chat_server):
    s = chat_server
    prompt = PROMPTS[3]
    pieces, reasons = [], []
    with httpx.stream("POST", s.url + "/v1/completions", json={
            "model": s.name, "prompt": prompt, "max_tokens": 32, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    for e in events[:-1]:
        pieces.append(e["choices"][0]["text"])
        reasons.append(e["choices"][0]["finish_reason"])
    assert len(pieces) > 2 and reasons[-1] in ("length", "stop") and set(reasons[:-1]) == {None}
    assert "".join(pieces) == text_of(s.gen, run_tokens(s.gen, prompt, 32))
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 32
    # The openai client's own stream reader sees the same text.
    stream = s.client.chat.completions.create(model=s.name, temperature=0, max_tokens=16,
                                              stream=True,
                                              messages=[{"role": "user", "content": prompt}])
    chat_text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert chat_text == text_of(s.gen, run_tokens(s.gen, prompt, 16, chat=True))


def test_stop_strings_cut_the_text_and_free_the_slot(chat_server):
    s = chat_server
    prompt = PROMPTS[4]
    full = text_of(s.gen, run_tokens(s.gen, prompt, 40))
    stop = full[10:13]
    assert stop.strip()
    out = s.client.completions.create(model=s.name, prompt=prompt, max_tokens=40, temperature=0,
                                      stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_32_concurrent_requests_all_succeed_each_equal_to_run(cb_server):
    s = cb_server
    client = AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)

    async def one(prompt):
        return await client.completions.create(model=s.name, prompt=prompt, max_tokens=20,
                                               temperature=0)

    async def all_of():
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    outs = asyncio.run(all_of())
    assert len(outs) == 32
    for prompt, out in zip(PROMPTS, outs):
        assert out.choices[0].text == text_of(s.gen, run_tokens(s.gen, prompt, 20)), prompt[:30]


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": "demo"}, 400, "prompt"),
    ({"model": "demo", "prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"model": "demo", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "demo", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ({"model": "demo", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "demo", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "demo", "prompt": "", "max_tokens": 3}, 400, "prompt"),
    ({"model": "demo", "prompt": "x", "max_tokens": 10**6}, 400, "maximum context length"),
    ({"model": "demo", "prompt": "x " * 4000}, 400, "maximum context length"),
    ({"model": "no-such-model", "prompt": "x"}, 404, "does not exist"),
    ({"model": "demo", "prompt": "x", "tools": []}, 400, "tools"),
])
def test_bad_requests_get_openai_errors_never_a_traceback(chat_server, body, status, needle):
    s = chat_server
    if isinstance(body, dict) and body.get("model") == "demo":
        body = {**body, "model": s.name}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(s.url + "/v1/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and "Traceback" not in r.text


def test_openai_client_raises_its_own_error_types(chat_server):
    s = chat_server
    with pytest.raises(NotFoundError):
        s.client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(BadRequestError):  # a validation error is 400, as in vLLM
        s.client.completions.create(model=s.name, prompt="x", max_tokens=2, temperature=9)
    with pytest.raises(BadRequestError):
        s.client.completions.create(model=s.name, prompt="x", max_tokens=10**6)
    assert httpx.get(s.url + "/nope").json()["error"]["message"].startswith("GET /nope: not found")
    assert httpx.get(s.url + "/health").status_code == 200
    models = s.client.models.list()
    assert [m.id for m in models.data] == [s.name]


def test_a_disconnecting_client_frees_its_slot(chat_server):
    """Batch 1: while a long stream holds the only slot, nothing else runs. Drop the stream
    after a few chunks: the next request gets its answer, the drop is counted as an abort, and
    the dropped request stopped generating instead of running to its 400 tokens."""
    s = chat_server
    before = s.metrics().get(("vllm:request_success_total",
                              (("finished_reason", "abort"), ("model_name", s.name))), 0.0)
    generated_key = ("vllm:generation_tokens_total", (("model_name", s.name),))
    generated_before = s.metrics().get(generated_key, 0.0)
    with httpx.stream("POST", s.url + "/v1/completions", json={
            "model": s.name, "prompt": PROMPTS[5], "max_tokens": 400, "temperature": 0,
            "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 4:
                break  # leaving the block closes the connection mid-stream
    out = s.client.completions.create(model=s.name, prompt=PROMPTS[6], max_tokens=8,
                                      temperature=0)
    assert out.choices[0].text == text_of(s.gen, run_tokens(s.gen, PROMPTS[6], 8))
    deadline = time.time() + 10
    while time.time() < deadline:
        after = s.metrics().get(("vllm:request_success_total",
                                 (("finished_reason", "abort"), ("model_name", s.name))), 0.0)
        if after == before + 1:
            break
        time.sleep(0.1)
    assert after == before + 1
    # the dropped stream stopped early: it and the short request made far fewer than the 400
    # tokens it asked for (a slot held to the end would count 400 + 8)
    assert s.metrics()[generated_key] - generated_before < 400


def test_metrics_add_up_to_the_requests_statistics(tmp_path):
    server = LiveServer(build(tmp_path, "shapes.full_batch_size=2"))
    try:
        prompts = PROMPTS[:6]
        for p in prompts:
            server.client.completions.create(model=server.name, prompt=p, max_tokens=24,
                                             temperature=0)
        want = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "prompt": 0, "gen": 0}
        per_pos: dict[int, int] = {}
        for p in prompts:
            st = server.gen.generate([p], max_new_tokens=24).rows[0].stats
            want["drafts"] += st.num_drafts
            want["draft_tokens"] += st.num_draft_tokens
            want["accepted"] += st.num_accepted_tokens
            want["prompt"] += st.prompt_tokens
            want["gen"] += st.new_tokens
            for j, n in enumerate(st.accepted_per_pos):
                per_pos[j] = per_pos.get(j, 0) + n
        m = server.metrics()
        label = (("model_name", server.name),)
        assert want["accepted"] > 0
        assert m[("vllm:spec_decode_num_drafts_total", label)] == want["drafts"]
        assert m[("vllm:spec_decode_num_draft_tokens_total", label)] == want["draft_tokens"]
        assert m[("vllm:spec_decode_num_accepted_tokens_total", label)] == want["accepted"]
        for j, n in per_pos.items():
            key = ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                   (("model_name", server.name), ("position", str(j))))
            assert m[key] == n
        assert m[("vllm:spec_decode_draft_acceptance_rate", label)] == pytest.approx(
            want["accepted"] / want["draft_tokens"])
        assert m[("vllm:prompt_tokens_total", label)] == want["prompt"]
        assert m[("vllm:generation_tokens_total", label)] == want["gen"]
        assert m[("vllm:e2e_request_latency_seconds_count", label)] == len(prompts)
        assert m[("vllm:time_to_first_token_seconds_count", label)] == len(prompts)
        assert m[("vllm:num_requests_running", label)] == 0
        assert not any(name.endswith("_created") for name, _ in m)
    finally:
        server.stop()

"""The server's per-request speculative statistics (vLLM's `metrics.speculative_decoding`) and
the goodput gate's counters on /metrics."""

from __future__ import annotations

import pytest

from helpers_server import PROMPTS, LiveServer, build

pytestmark = pytest.mark.slow


def spec_metrics(response) -> dict:
    return response.model_extra["metrics"]["speculative_decoding"]


def test_a_response_carries_its_requests_acceptance_as_vllm_does(tmp_path):
    server = LiveServer(build(tmp_path))
    try:
        prompt = PROMPTS[3]
        m = spec_metrics(server.client.completions.create(model=server.name, prompt=prompt,
                                                          max_tokens=24, temperature=0))
        st = server.gen.generate([prompt], max_new_tokens=24).rows[0].stats  # same, greedy
        assert m["num_spec_steps"] == st.num_drafts > 0
        assert m["num_draft_tokens"] == st.num_draft_tokens
        assert m["num_accepted_draft_tokens"] == st.num_accepted_tokens
        assert m["num_accepted_tokens_per_pos"] == st.accepted_per_pos
        hist = m["acceptance_histogram"]
        assert len(hist) == m["num_spec_tokens"] + 1 and sum(hist) == m["num_spec_steps"]
        assert sum(j * n for j, n in enumerate(hist)) == m["num_accepted_draft_tokens"]
        assert m["mean_acceptance_length"] == pytest.approx(
            1 + m["num_accepted_draft_tokens"] / m["num_spec_steps"])
        assert m["draft_acceptance_rate"] == pytest.approx(
            m["num_accepted_draft_tokens"] / m["num_draft_tokens"])
        # two prompts in one request: null, as vLLM for n > 1
        two = server.client.completions.create(model=server.name, prompt=PROMPTS[:2],
                                               max_tokens=4, temperature=0)
        assert two.model_extra["metrics"] is None
    finally:
        server.stop()


def test_metrics_count_steps_and_policy_switches(tmp_path):
    server = LiveServer(build(tmp_path, "speculation.policy=auto", "shapes.full_batch_size=2"))
    try:
        on = off = 0
        for p in PROMPTS[:6]:
            m = spec_metrics(server.client.completions.create(
                model=server.name, prompt=p, max_tokens=48, temperature=1.0, seed=1))
            on, off = on + m["steps_with_speculation"], off + m["steps_without_speculation"]
        assert on > 0 and off > 0  # the gate measured both sides
        got = server.metrics()
        label = ("model_name", server.name)
        assert got[("qpcbuild:spec_decode_steps_total", (label, ("speculation", "on")))] == on
        assert got[("qpcbuild:spec_decode_steps_total", (label, ("speculation", "off")))] == off
        switches = server.gen.decoder.gate().switches
        counted = sum(v for (name, _), v in got.items()
                      if name == "qpcbuild:spec_decode_policy_switches_total")
        assert counted == len(switches)
    finally:
        server.stop()

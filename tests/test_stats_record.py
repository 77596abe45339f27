"""The statistics record (runtime/stats.py): its figures against numbers worked out by hand,
records added up, the JSON that `run --json` and the bench read, and that no reader outside the
record recomputes acceptance from a dict of counts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qpcbuild.runtime.rows import GateStats, LoopTimes, RequestStats, Row
from qpcbuild.runtime.stats import SpecDecodingStats

PACKAGE = Path(__file__).resolve().parent.parent / "qpcbuild"
RECORD = PACKAGE / "runtime" / "stats.py"


def _row(new_tokens: int, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int],
         reason: str = "length", ttft_s: float = 0.25) -> Row:
    return Row([1, 2, 3], 64, stats=RequestStats(
        prompt_tokens=3, new_tokens=new_tokens, finish_reason=reason, ttft_s=ttft_s, e2e_s=2.0,
        num_drafts=drafts,
        num_draft_tokens=draft_tokens, num_accepted_tokens=accepted, accepted_per_pos=per_pos))


def _first_call() -> SpecDecodingStats:
    # Row A: two steps at K=2, 2 then 1 accepted; row B: one step at K=4, 2 accepted.
    rows = [_row(5, 2, 4, 3, [2, 1]), _row(4, 1, 4, 2, [1, 1, 0, 0], reason="eos", ttft_s=0.45)]
    times = LoopTimes(prefill_s=0.5, draft_s=0.4, target_s=1.1, total_s=2.5, target_calls=6,
                      draft_calls=5, catch_up_calls=1, windows={4: 1, 2: 2})
    return SpecDecodingStats.from_rows(rows, times, "draft_model")


def _second_call() -> SpecDecodingStats:
    # one row: one step at K=3, all 3 accepted
    times = LoopTimes(prefill_s=0.3, draft_s=0.2, target_s=0.6, total_s=1.5, target_calls=3,
                      draft_calls=3, windows={3: 1})
    return SpecDecodingStats.from_rows([_row(4, 1, 3, 3, [1, 1, 1])], times, "draft_model")


def test_one_call_figures_by_hand():
    st = _first_call()
    assert (st.requests, st.new_tokens, st.decode_tokens) == (2, 9, 7)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 8, 5)
    assert st.accepted_per_pos == (3, 2, 0, 0)
    assert st.acceptance_rate == pytest.approx(0.625)  # 5 of 8 proposed
    assert st.mean_acceptance_length == pytest.approx(8 / 3)  # 3 steps gave 3 + 5 tokens
    assert st.acceptance_per_position == pytest.approx([1.0, 2 / 3, 0.0, 0.0])
    assert st.ttft_s == pytest.approx(0.35)  # each request's own (0.25, 0.45), not the prefill
    assert st.decode_tokens_per_s == pytest.approx(3.5)  # 7 tokens in 2.0 s after prefill
    assert st.e2e_tokens_per_s == pytest.approx(3.6)  # 9 tokens in 2.5 s
    assert st.host_overhead_s == pytest.approx(1.0)  # 2.5 s less 1.5 s in the models
    assert st.host_overhead_fraction == pytest.approx(0.4)
    a, b = st.per_request
    assert (a.acceptance_rate, a.mean_acceptance_length) == (0.75, 2.5)
    assert (b.acceptance_rate, b.mean_acceptance_length, b.finish_reason) == (0.5, 3.0, "eos")


def test_records_add_up_by_hand():
    total = SpecDecodingStats.merged([_first_call(), _second_call()])
    assert total == _first_call() + _second_call()
    assert (total.generate_calls, total.requests, total.new_tokens, total.decode_tokens) == \
        (2, 3, 13, 10)
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (4, 11, 8)
    assert total.accepted_per_pos == (4, 3, 1, 0)
    assert total.acceptance_rate == pytest.approx(8 / 11)
    assert total.mean_acceptance_length == pytest.approx(3.0)  # 4 steps gave 4 + 8 tokens
    assert total.ttft_s == pytest.approx((0.25 + 0.45 + 0.25) / 3)  # over the three requests
    assert total.decode_tokens_per_s == pytest.approx(10 / 3.2)  # 10 tokens in 4.0 - 0.8 s
    assert total.host_overhead_s == pytest.approx(1.7)  # 4.0 s less 0.6 + 1.7 in the models
    assert total.verify_windows == {2: 2, 3: 1, 4: 1}
    assert (total.target_calls, total.draft_calls, total.catch_up_calls) == (9, 8, 1)
    assert len(total.per_request) == 3


def test_no_drafts_means_no_rates():
    st = SpecDecodingStats.from_rows([_row(6, 0, 0, 0, [])], LoopTimes(total_s=1.0), "ngram")
    assert st.acceptance_rate is None and st.mean_acceptance_length is None
    assert st.acceptance_per_position == []
    assert st.to_json()["acceptance_rate"] is None
    # a request's own figures (the server's response) are 0 and 1 then, as vLLM's
    assert st.per_request[0].to_json()["acceptance_rate"] == 0.0
    assert st.per_request[0].to_json()["mean_acceptance_length"] == 1.0


def test_a_request_has_one_record_counted_live_and_kept_as_the_call_ended():
    """The row's statistics are the record the call's `per_request` holds (no second class to
    copy field by field): its finish reason is the row's, and the snapshot the call keeps does
    not move when the same record counts on."""
    row = _row(5, 2, 4, 3, [2, 1], reason="")
    row.finish_reason = "eos"
    assert row.stats.finish_reason == "eos"
    kept = SpecDecodingStats.from_rows([row], LoopTimes(total_s=1.0), "draft_model").per_request[0]
    assert isinstance(kept, RequestStats) and kept == row.stats and kept is not row.stats
    row.stats.accepted_per_pos[0] += 1
    row.stats.num_accepted_tokens += 1
    assert (kept.accepted_per_pos, kept.num_accepted_tokens) == ([2, 1], 3)
    assert kept.to_json()["finish_reason"] == "eos" and kept.acceptance_rate == 0.75


def test_json_of_a_call_and_of_a_run():
    """The keys and rounding that `qpcbuild run --json` and the bench have always written."""
    call = _first_call().to_json()
    assert list(call) == [
        "method", "requests", "new_tokens", "ttft_s", "e2e_s", "decode_tokens_per_s",
        "e2e_tokens_per_s", "draft_time_s", "target_time_s", "host_overhead_s",
        "host_overhead_fraction", "target_calls", "draft_calls", "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos", "acceptance_rate", "mean_acceptance_length",
        "verify_windows", "draft_catch_up_calls", "per_request"]
    assert (call["acceptance_rate"], call["mean_acceptance_length"]) == (0.625, 2.6667)
    assert call["spec_decode_num_accepted_tokens_per_pos"] == [3, 2, 0, 0]
    assert call["verify_windows"] == {"2": 2, "4": 1}
    assert call["per_request"][0] == {
        "prompt_tokens": 3, "new_tokens": 5, "finish_reason": "length", "ttft_s": 0.25,
        "e2e_s": 2.0, "spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 4,
        "spec_decode_num_accepted_tokens": 3, "acceptance_rate": 0.75,
        "mean_acceptance_length": 2.5, "steps_with_speculation": 0,
        "steps_without_speculation": 0}
    run = SpecDecodingStats.merged([_first_call(), _second_call()]).totals_json()
    assert list(run) == [k for k in call if k not in (
        "method", "verify_windows", "draft_catch_up_calls", "per_request")]
    assert (run["acceptance_rate"], run["mean_acceptance_length"]) == (0.7273, 3.0)
    assert (run["ttft_s"], run["e2e_s"], run["decode_tokens_per_s"]) == (0.3167, 4.0, 3.12)


def test_the_gates_steps_are_kept_and_added_up():
    switch = {"step": 3, "to": "plain", "reason": "slower"}
    gated = LoopTimes(total_s=1.0, speculation=GateStats("auto", 4, 2, (switch,), 3))
    one = SpecDecodingStats.from_rows([_row(3, 1, 2, 1, [1, 0])], gated, "draft_model")
    assert one.to_json()["speculation"] == {
        "policy": "auto", "steps_with_speculation": 4, "steps_without_speculation": 2,
        "shadow_checks": 3, "policy_switches": [switch]}
    total = one + one
    assert (total.speculation.steps_with_speculation,
            total.speculation.steps_without_speculation) == (8, 4)
    assert total.speculation.policy_switches == (switch, switch)
    assert total.speculation.shadow_checks == 6
    assert "speculation" not in _first_call().to_json()  # no gate ran


def test_no_reader_recomputes_acceptance_from_a_dict():
    """Acceptance comes from the record's properties: no module but the record indexes a
    statistics dict by the count keys (as the five readers did before the record)."""
    indexing = re.compile(r"""(\[|\.get\()\s*["']spec_decode_num_(drafts|draft_tokens|"""
                          r"""accepted_tokens)["']""")
    offenders = [f"{path.relative_to(PACKAGE)}:{n}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path != RECORD
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if indexing.search(line)]
    assert offenders == []

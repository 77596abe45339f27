"""Our bundle and a memory-heavy peer (vLLM loads its own float32 copy of both models) take
turns in memory during `qpcbuild bench`: sessions released and loaded again between passes,
never inside one, and the tokens after a reload equal those before it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qpcbuild import bench
from qpcbuild.bench import PEERS
from qpcbuild.bench.peers import Peer
from qpcbuild.bench.records import Measure
from qpcbuild.runtime import loader
from qpcbuild.runtime.loader import load
from qpcbuild.runtime.session import OrtSession

ROOT = Path(__file__).resolve().parents[1]
DEMO = Path(os.environ.get("QPCBUILD_TEST_DEMO") or ROOT / "models" / "demo")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("turns")
    return bench.build_for_measurement(
        ROOT / "recipes" / "demo.yaml",
        [f"target.model={DEMO / 'target'}", f"draft.model={DEMO / 'draft'}"], [0, 2],
        root / "bundle", root / "cache")


def test_a_released_session_loads_again_and_decodes_the_same_tokens(bundle):
    gen = load(bundle, method="draft_model", k=2)
    prompt = "def add(a, b):"
    before = gen.generate([prompt], max_new_tokens=12).rows[0].tokens
    for s in (gen.target, gen.draft):
        s.release()
        assert s.released and s.sess is None
    # the next call loads it again by itself ...
    assert gen.generate([prompt], max_new_tokens=12).rows[0].tokens == before
    assert not gen.target.released and not gen.draft.released
    # ... and reopen() does it ahead of a call (what bench does, outside its timed passes)
    gen.target.release()
    gen.target.reopen()
    assert gen.generate([prompt], max_new_tokens=12).rows[0].tokens == before


def _heavy_peer(events: list[str]):
    def make(manifest, ks, max_new, eos_ids, cache_dir, say):
        peer = Peer("heavy", "ok", note="stand-in for a peer with its own copy of the models")
        peer.memory_bytes = 10 * 2**30
        peer.stop = lambda: events.append("stop")

        def run(prompt_ids, acc):
            events.append("peer")
            return [[1] * 4 for _ in prompt_ids], 4 * len(prompt_ids), 0.01
        peer.cases.append((Measure("heavy", "target_only", None, "target-only"), run))
        return peer
    return make


def _record(monkeypatch, events: list[str]) -> None:
    for name in ("release", "reopen"):
        original = getattr(OrtSession, name)

        def wrapped(self, _original=original, _name=name):
            events.append(f"{_name} {self.role}")
            _original(self)
        monkeypatch.setattr(OrtSession, name, wrapped)


@pytest.mark.parametrize("free_gib, turns", [(4, True), (64, False)])
def test_bench_makes_room_for_a_heavy_peer_only_when_memory_is_short(bundle, monkeypatch,
                                                                     free_gib, turns):
    events: list[str] = []
    monkeypatch.setitem(PEERS, "heavy", _heavy_peer(events))
    monkeypatch.setattr(loader, "available_memory", lambda: free_gib * 2**30)
    _record(monkeypatch, events)
    prompts = bench.load_prompts(prompt_set="code", limit=2)[1]
    report = bench.run_bench(bundle, prompts, ks=[2], methods=["draft_model"], max_new_tokens=8,
                             repeats=1, peers=("heavy",))
    # Reloaded sessions decode exactly as before: every row equals target-only's tokens.
    assert report["all_greedy_outputs_match"] is True
    assert report["peers"]["heavy"]["status"] == "ok"
    if not turns:
        assert events == ["peer", "peer"]  # warm-up and one repeat, ours never released
        assert not any("released" in n for n in report.get("notes", []))
        return
    # Warm-up pass: ours, then released for the peer. Repeat: the peer stops, ours load again
    # before any of our configurations runs, and are released again for the peer.
    released = ["release target", "release draft"]
    assert events == released + ["peer", "stop", "reopen target", "reopen draft"] + \
        released + ["peer"]
    assert any("released 2 time(s)" in n for n in report["notes"])

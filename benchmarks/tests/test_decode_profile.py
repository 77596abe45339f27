"""benchmarks/decode_profile.py: one decode call of a bench bundle broken down by operator, on
the demo pair (models/demo, committed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import decode_profile
from qpcbuild.bench import build_for_measurement

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"


@pytest.fixture(scope="module")
def demo_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("profile")
    return build_for_measurement(ROOT / "recipes" / "demo.yaml",
                                 [f"target.model={DEMO / 'target'}", f"draft.model={DEMO / 'draft'}"],
                                 [0, 1, 2], root / "bundle", root / "cache")


def test_decode_profile_breaks_a_call_down_by_operator(demo_bundle):
    for role, seq_lens in (("target", [1, 3]), ("draft", [1])):
        r = decode_profile.profile(demo_bundle, seq_lens, calls=4, role=role)
        assert [w["seq_len"] for w in r["windows"]] == seq_lens and r["role"] == role
        for w in r["windows"]:
            # every MatMul of the graph ran: the op table holds them, and kernel time sits
            # inside the calls' wall time (means of the same calls)
            assert w["ops_ms"].get("MatMul", 0) > 0 and w["matmul_gbs"] > 0
            assert 0 < w["kernels_ms"] <= w["call_ms"] * 1.05
        assert r["probe"]["gbs"] > 0 and r["threads"] >= 1

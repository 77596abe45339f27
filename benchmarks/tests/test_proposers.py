"""benchmarks/proposers.py: two bundles' proposers (a draft model and an EAGLE-3 head for the
same target) interleaved in one process, end to end on the smallest setting, and a bad
--bundle refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks import proposers as bench
from qpcbuild.cli import app
from qpcbuild.testing import write_shortcut_eagle3_head

REPO = Path(__file__).resolve().parents[2]


def compile_demo(root: Path, *sets: str) -> Path:
    argv = ["compile", str(REPO / "recipes" / "demo.yaml"), "-o", str(root / "b"),
            "--cache-dir", str(root.parent / "cache"),
            "--set", "speculation.num_speculative_tokens=[0,1]"]
    for s in sets:
        argv += ["--set", s]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    return root / "b"


def test_a_draft_and_a_head_run_side_by_side(tmp_path, capsys):
    draft = compile_demo(tmp_path / "draft")
    head = write_shortcut_eagle3_head(tmp_path / "head", REPO / "models" / "demo" / "target")
    eagle3 = compile_demo(tmp_path / "eagle3", "draft.method=eagle3", f"draft.model={head}")
    out = tmp_path / "proposers.json"
    rc = bench.main(["--bundle", f"draft={draft}", "--bundle", f"head={eagle3}", "--ks", "1",
                     "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "2",
                     "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["greedy_outputs_equal_target_only"] is True
    rows = {(r["bundle"], r["k"]): r for r in report["rows"]}
    assert set(rows) == {("draft", 0), ("draft", 1), ("head", 0), ("head", 1)}
    for name in ("draft", "head"):
        assert rows[(name, 0)]["speedup"] == {"mean": 1.0, "std": 0.0}
        assert rows[(name, 1)]["mean_acceptance_length"] >= 1.0
        assert rows[(name, 1)]["proposer_ms_per_call"] > 0  # a head's calls count too
    assert "| head | 1 |" in capsys.readouterr().out


def test_a_bundle_that_is_not_a_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--bundle", f"x={tmp_path / 'missing'}"])
    assert exc.value.code == 2 and "expected NAME=PATH" in capsys.readouterr().err

"""benchmarks/k_schedule.py: the K schedule against fixed Ks under continuous batching, run end
to end on the smallest setting, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks import k_schedule as bench
from qpcbuild.cli import app

REPO = Path(__file__).resolve().parents[2]


def compile_cb(recipe: str, root: Path, ks: str, schedule: str) -> Path:
    """`recipe` with 2 KV slots, these Ks and this K schedule in its manifest."""
    result = CliRunner().invoke(app, [
        "compile", str(REPO / "recipes" / recipe), "-o", str(root / "b"),
        "--cache-dir", str(root / "cache"), "--set", "shapes.full_batch_size=2",
        "--set", f"speculation.num_speculative_tokens={ks}",
        "--set", f"speculation.num_speculative_tokens_per_batch_size={schedule}"])
    assert result.exit_code == 0, result.output
    return root / "b"


@pytest.fixture(scope="module")
def cb_bundle(tmp_path_factory) -> Path:
    """The demo pair with Ks 0, 1, 4 and the schedule {1: 4, 2: 1}."""
    return compile_cb("demo.yaml", tmp_path_factory.mktemp("kschedule"), "[0,1,4]",
                      "{1: 4, 2: 1}")


@pytest.mark.slow
def test_schedule_and_fixed_ks_run_end_to_end(cb_bundle, tmp_path, capsys):
    out = tmp_path / "k_schedule.json"
    rc = bench.main(["--bundle", str(cb_bundle), "--concurrency", "1,2", "--max-new-tokens",
                     "8", "--repeats", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["schedule"] == {"1": 4, "2": 1} and report["schedule_source"] == "bundle manifest"
    assert report["problems"] == []
    steps = {(r["concurrency"], r["config"]): r["steps_by_live_rows_and_k"]
             for r in report["summary"]}
    assert set(steps) == {(c, n) for c in (1, 2) for n in ("schedule", "K=0", "K=1", "K=4")}
    # two rows of different lengths: K=1 while both are live, K=4 for the one left
    assert set(steps[2, "schedule"]) == {"2:1", "1:4"}
    assert set(steps[2, "K=4"]) == {"2:4", "1:4"} and set(steps[1, "schedule"]) == {"1:4"}
    table = capsys.readouterr().out
    assert "| 2 | schedule |" in table and "x best fixed K" in table


def test_a_schedule_naming_an_uncompiled_k_is_refused(cb_bundle, tmp_path, capsys):
    out = tmp_path / "k_schedule.json"
    rc = bench.main(["--bundle", str(cb_bundle), "--schedule", "1:4,2:2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "2:2: K=2 is not compiled" in err and "[0, 1, 4]" in err
    assert "Traceback" not in err and not out.exists()
    # before building anything: K=9 is outside the Ks the bundle would compile
    assert bench.main(["--schedule", "1:9", "--k-max", "4", "--out", str(out)]) == 2
    assert "K=9 is not compiled" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["1:4,2", "0:4", "a:b", "1:-1"])
def test_a_malformed_schedule_is_refused(text, tmp_path, capsys):
    assert bench.main(["--schedule", text, "--out", str(tmp_path / "r.json")]) == 2
    assert "--schedule" in capsys.readouterr().err


def test_steps_at_the_wrong_k_are_found():
    schedule = {1: 4, 2: 1}
    assert bench.wrong_steps({(2, 1): 3, (1, 4): 2}, schedule, None, 4) == []
    # a run that ignored the schedule (K=4 with two live rows) is caught, as is a fixed K that moved
    assert bench.wrong_steps({(2, 4): 3, (1, 4): 2}, schedule, None, 4) == [(2, 4)]
    assert bench.wrong_steps({(2, 4): 3, (1, 1): 2}, schedule, 4, 4) == [(1, 1)]
    assert bench.scheduled_k({2: 3, 4: 1}, 1, 5) == 5  # fewer rows than the first size: K_max


def test_a_model_free_recipe_is_measured_with_its_own_method(tmp_path, capsys):
    # The benchmark loads the method the bundle was built for: an ngram CB bundle has no
    # draft (loading it as draft_model is refused), and its schedule runs as recorded.
    bundle = compile_cb("demo-ngram.yaml", tmp_path, "[0,4]", "{1: 4, 2: 0}")
    out = tmp_path / "k_schedule.json"
    rc = bench.main(["--bundle", str(bundle), "--concurrency", "2", "--max-new-tokens",
                     "8", "--repeats", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["problems"] == []
    steps = {r["config"]: r["steps_by_live_rows_and_k"] for r in report["summary"]}
    assert set(steps["schedule"]) <= {"2:0", "1:4"} and "2:0" in steps["schedule"]

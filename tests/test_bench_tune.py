"""`qpcbuild bench` and `qpcbuild tune`: the report's contents on a tiny bundle of the demo pair
(peers forced missing), and tune's model and recipe rewriting as pure functions."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild import bench, tune
from qpcbuild.cli import app
from qpcbuild.errors import UsageError
from qpcbuild.recipe import load_recipe, recipe_from_text

ROOT = Path(__file__).resolve().parents[1]
# QPCBUILD_TEST_DEMO: another folder holding target/ and draft/ of the same shapes (for
# development while models/demo is being trained).
DEMO = Path(os.environ.get("QPCBUILD_TEST_DEMO") or ROOT / "models" / "demo")
needs_demo = pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(),
                                reason="demo pair not trained yet (scripts/train_demo_pair.py)")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def demo_overrides() -> list[str]:
    return [f"target.model={DEMO / 'target'}", f"draft.model={DEMO / 'draft'}"]


# ---------------------------------------------------------------- tune: the model
def test_conditional_acceptance_and_expected_tokens_by_hand():
    # 100 drafts; position 1 accepted 80 times, position 2 40 times, position 3 10 times.
    alphas = tune.conditional_acceptance([80, 40, 10], 100)
    assert alphas == pytest.approx([0.8, 0.5, 0.25])
    # E(K) = 1 + sum_{i<=K} prod_{j<=i} alpha_j
    assert tune.expected_tokens(alphas, 0) == pytest.approx(1.0)
    assert tune.expected_tokens(alphas, 1) == pytest.approx(1.8)
    assert tune.expected_tokens(alphas, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert tune.expected_tokens(alphas, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert tune.expected_tokens(alphas, 5) == pytest.approx(2.3)  # no evidence beyond 3: 0
    assert tune.all_accepted(alphas, 2) == pytest.approx(0.4)
    assert tune.conditional_acceptance([0, 0], 0) == [0.0, 0.0]


def test_predict_draft_model_cost_by_hand():
    alphas = [0.8, 0.5]
    t_verify = {0: 1e-3, 1: 1.2e-3, 2: 1.5e-3}
    rows = tune.predict("draft_model", alphas, 0.1e-3, t_verify, 0.05e-3, 1.0, [1, 2],
                        host_target_only=0.05e-3)
    r1, r2 = rows
    # K=1: E = 1.8; cost = (1 + 0.8) draft steps + verify(1) + host
    assert r1["expected_tokens_per_step"] == pytest.approx(1.8)
    assert r1["cost_ms"] == pytest.approx(1.8 * 0.1 + 1.2 + 0.05, abs=1e-3)
    assert r1["tokens_per_s"] == pytest.approx(1.8 / ((1.8 * 0.1 + 1.2 + 0.05) * 1e-3), rel=1e-3)
    # K=2: E = 2.2; catch-up probability 0.4
    assert r2["cost_ms"] == pytest.approx(2.4 * 0.1 + 1.5 + 0.05, abs=1e-3)
    base = 1 / (1.05e-3)
    assert r2["predicted_speedup"] == pytest.approx(r2["tokens_per_s"] / base, rel=1e-3)


def test_predict_model_free_counts_steps_without_a_proposal():
    rows = tune.predict("ngram", [1.0], None, {0: 1e-3, 1: 2e-3}, 0.0, 0.5, [1])
    # half the steps: 2 tokens at 2 ms; the other half: 1 token at 1 ms
    assert rows[0]["expected_tokens_per_step"] == pytest.approx(1.5)
    assert rows[0]["cost_ms"] == pytest.approx(1.5)


def test_host_model_is_linear_between_the_measured_points():
    h = tune.host_model({1: 0.1, 5: 0.5})
    assert h(1) == pytest.approx(0.1) and h(3) == pytest.approx(0.3) and h(8) == pytest.approx(0.8)
    assert tune.host_model({4: 0.2})(7) == pytest.approx(0.2)


def test_choose_k_is_the_argmax_of_a_synthetic_evidence_table():
    table = [{"k": 1, "tokens_per_s": 100.0}, {"k": 2, "tokens_per_s": 140.0},
             {"k": 3, "tokens_per_s": 155.0}, {"k": 4, "tokens_per_s": 150.0},
             {"k": 5, "tokens_per_s": 155.0}]
    assert tune.choose_k(table) == 3  # ties go to the smaller K
    assert tune.choose_k([{"k": 7, "tokens_per_s": 1.0}]) == 7
    with pytest.raises(UsageError):
        tune.choose_k([])
    assert tune.recommended_ks("draft_model", 4) == [4]
    assert tune.recommended_ks("ngram", 4) == [0, 4]


def _fake_result(k: int, method: str = "draft_model") -> dict:
    return {"chosen_k": k, "method": method, "created": "2026-01-01T00:00:00+00:00",
            "prompt_set": "code",
            "table": [{"k": kk, "tokens_per_s": 100.0 + kk, "predicted_speedup": 1.5,
                       "expected_tokens_per_step": 2.0, "cost_ms": 1.0, "vs_best": 0.0}
                      for kk in (1, 2, 3)],
            "calibration": {"prompts": 2, "acceptance_per_position": [0.9, 0.8, 0.7],
                            "proposal_fraction": 1.0},
            "costs": {"verify_ms": {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, "draft_step_ms": 0.2}}


@pytest.mark.parametrize("recipe", ["recipes/demo.yaml", "recipes/demo-ngram.yaml"])
def test_write_produces_a_recipe_that_load_recipe_accepts_with_the_chosen_k(tmp_path, recipe):
    out = tune.write_tuned_recipe(ROOT / recipe, _fake_result(3, load_recipe(ROOT / recipe)
                                                              .draft.method),
                                  tmp_path / "sub" / "tuned.yaml")
    r = load_recipe(out)
    orig = load_recipe(ROOT / recipe)
    assert r.speculation.num_speculative_tokens == 3
    assert r.ks == tuple(tune.recommended_ks(orig.draft.method, 3))
    # the copy points at the same model folders and keeps every other setting
    assert Path(r.source_dir() / r.target.model).resolve() == \
        Path(orig.source_dir() / orig.target.model).resolve()
    assert r.shapes == orig.shapes and r.hardware == orig.hardware
    text = out.read_text()
    assert text.count(tune.TUNE_MARK) >= 3 and "K=3 chosen by `qpcbuild tune`" in text
    # in place, twice: the second evidence replaces the first
    inplace = tmp_path / "inplace.yaml"
    inplace.write_text((ROOT / recipe).read_text().replace("../models", str(ROOT / "models")))
    tune.write_tuned_recipe(inplace, _fake_result(2, orig.draft.method))
    tune.write_tuned_recipe(inplace, _fake_result(1, orig.draft.method))
    again = inplace.read_text()
    assert load_recipe(inplace).speculation.num_speculative_tokens == 1
    assert again.count("chosen by `qpcbuild tune`") == 1
    kept = [x for x in (ROOT / recipe).read_text().splitlines()
            if "num_speculative_tokens" not in x and "model:" not in x]
    assert all(line in again.splitlines() for line in kept)


def test_patch_handles_block_lists_and_a_missing_speculation_section():
    base = "schema: 1\nname: x\ntarget:\n  model: /nonexistent/t\ndraft:\n  method: ngram\n"
    for text in (base + "speculation:\n  num_speculative_tokens:\n    - 0\n    - 4\n",
                 base + "speculation:\n  num_speculative_tokens: [0,\n    4]\n",
                 base + "shapes:\n  ctx_len: 512\n"):
        r = recipe_from_text(text)
        out = tune.patch_recipe_text(text, r, 5, ["# tune: evidence"])
        assert recipe_from_text(out).speculation.num_speculative_tokens == 5


# ---------------------------------------------------------------- bench: inputs
def test_parse_ks_and_shipped_prompt_sets():
    assert bench.parse_ks("1-3,6") == [1, 2, 3, 6]
    assert bench.parse_ks("4,2,2") == [2, 4]
    assert bench.parse_ks(None) is None
    with pytest.raises(UsageError):
        bench.parse_ks("3-1")
    with pytest.raises(UsageError):
        bench.parse_ks("a")
    for name in bench.PROMPT_SETS:
        label, prompts = bench.load_prompts(prompt_set=name)
        assert label == name and len(prompts) >= 8 and all(isinstance(p, str) and p
                                                           for p in prompts)
    with pytest.raises(UsageError):
        bench.load_prompts(prompt_set="poetry")


# ---------------------------------------------------------------- bench and tune on the demo pair
@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bench")
    return bench.build_for_measurement(ROOT / "recipes" / "demo.yaml", demo_overrides(),
                                       [0, 1, 2], root / "bundle", root / "cache")


def _no_peers(monkeypatch):
    # `None` in sys.modules makes `import x` raise ImportError: the peers look uninstalled.
    for mod in ("torch", "transformers", "onnxruntime_genai"):
        monkeypatch.setitem(sys.modules, mod, None)


@needs_demo
def test_bench_report_rows_speedups_greedy_and_plot(tiny_bundle, tmp_path, monkeypatch):
    _no_peers(monkeypatch)
    prompts = bench.load_prompts(prompt_set="code", limit=2)[1]
    report = bench.run_bench(tiny_bundle, prompts, prompt_label="code", ks=[1, 2],
                             max_new_tokens=16, repeats=1, cache_dir=tmp_path / "cache")
    rows = report["rows"]
    assert rows[0]["method"] == "target_only" and rows[0]["k"] == 0
    got = {(r["method"], r["k"]) for r in rows[1:]}
    assert got == {(m, k) for m in ("draft_model", "ngram", "suffix") for k in (1, 2)}
    base = rows[0]["tokens_per_s"]["mean"]
    for r in rows:
        assert r["tokens_per_s"]["mean"] > 0
        assert r["speedup"]["mean"] == pytest.approx(r["tokens_per_s"]["mean"] / base, rel=2e-3)
        assert r["greedy_matches_target_only"] is True
        assert r["new_tokens_per_repeat"] == 2 * 16
    assert report["all_greedy_outputs_match"] is True
    spd = [r for r in rows if r["method"] == "draft_model"]
    assert all(0 <= r["acceptance_rate"] <= 1 and r["ideal_speedup"] > 0 for r in spd)
    assert all(len(r["acceptance_per_position"]) == r["k"] for r in spd)
    for name in ("transformers", "onnxruntime-genai"):
        assert report["peers"][name]["status"] == "skipped"
        assert "not installed" in report["peers"][name]["note"]
    assert "goals" not in report  # a user's report holds their results, not ours
    path = bench.write_json(report, tmp_path / "r.json")
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(rows))
    png = bench.plot_report(report, tmp_path / "r.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "| draft_model | 2 |" in bench.markdown_table(report)


@needs_demo
def test_bench_cli_on_a_bundle(tiny_bundle, tmp_path, monkeypatch):
    _no_peers(monkeypatch)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n    return"}) + "\n")
    res = CliRunner().invoke(app, ["bench", str(tiny_bundle), "--prompts", str(prompts),
                                   "--ks", "1", "--methods", "ngram", "--max-new-tokens", "8",
                                   "--repeats", "1", "--json-out", str(tmp_path / "b.json")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "b.json").read_text())
    assert [(r["method"], r["k"]) for r in report["rows"]] == [("target_only", 0), ("ngram", 1)]
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG_MAGIC
    assert "skipped" in res.output
    bad = CliRunner().invoke(app, ["bench", str(tiny_bundle), "--ks", "5", "--peers", "none"])
    assert bad.exit_code == 2 and "not compiled" in bad.output


@needs_demo
def test_tune_measures_and_writes_a_recipe(tmp_path):
    result = tune.tune(ROOT / "recipes" / "demo.yaml", demo_overrides(), k_max=2, num_prompts=2,
                       max_new_tokens=16, rounds=3, cache_dir=tmp_path / "cache")
    assert result["chosen_k"] in (1, 2)
    assert [r["k"] for r in result["table"]] == [1, 2]
    assert result["chosen_k"] == max(result["table"], key=lambda r: r["tokens_per_s"])["k"]
    cal = result["calibration"]
    assert len(cal["alpha"]) == 2 and cal["num_drafts"] > 0
    assert set(result["costs"]["verify_ms"]) == {0, 1, 2}
    for check in result["model_check"][1:]:  # greedy: the replayed loop is the real loop
        assert check["accepted_replayed"] == check["accepted_measured"]
        assert check["drafts_replayed"] == check["drafts_measured"]
    out = tune.write_tuned_recipe(ROOT / "recipes" / "demo.yaml", result, tmp_path / "t.yaml")
    assert load_recipe(out).speculation.num_speculative_tokens == result["chosen_k"]


@needs_demo
def test_compile_tune_builds_with_the_chosen_k_and_records_the_evidence(tmp_path):
    from qpcbuild.bundle import read_manifest

    out = tmp_path / "bundle"
    args = ["compile", str(ROOT / "recipes" / "demo.yaml"), "--tune", "-o", str(out),
            "--cache-dir", str(tmp_path / "cache"), "--json"]
    for o in demo_overrides() + ["speculation.num_speculative_tokens=2"]:
        args += ["--set", o]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    m = read_manifest(out)
    assert m["tuning"]["chosen_k"] == max(m["speculation"]["num_speculative_tokens"])
    assert m["tuning"]["table"] and m["tuning"]["calibration"]["num_drafts"] > 0


# ---------------------------------------------------------------- tune: replaying the loop
def test_replay_draft_by_hand():
    # matches[i]: the draft's next token after output token i equals output token i+1
    m = [True, True, False, True, True, True, False, False]
    st = tune.replay_draft(m, n_out=9, max_new=9, k=2)
    # steps: [1,2 accepted + 3] -> [4,5 accepted + 6, catch-up] -> [7 rejected + 7,
    # catch-up, 1 draft: room 1] -> [no room: target only]
    assert (st["steps"], st["drafts"], st["draft_tokens"], st["accepted"]) == (4, 3, 5, 4)
    assert st["per_pos"] == [2, 2] and st["catch_up"] == 2 and st["tokens"] == 8


class _Oracle:
    """A proposer that knows the output and proposes its next tokens, the first one wrong every
    third step."""

    def __init__(self, output):
        self.output, self.calls = output, []

    def start(self, rid, tokens):
        self.seen = len(tokens)
        self.prompt_len = len(tokens) - 1
        self.calls.append(("start", len(tokens)))

    def extend(self, rid, tokens):
        self.seen += len(tokens)
        self.calls.append(("extend", list(tokens)))

    def propose(self, rid, k):
        done = self.seen - self.prompt_len
        guess = self.output[done:done + k]
        if sum(c[0] == "extend" for c in self.calls) % 3 == 2 and guess:
            guess = [-1] + guess[1:]
        return guess

    def finish(self, rid):
        self.calls.append(("finish",))


def test_replay_proposer_drives_the_proposer_like_the_engine():
    out = list(range(100, 120))
    prop = _Oracle(out)
    st = tune.replay_proposer(prop, [1, 2, 3], out, max_new=20, k=3)
    assert prop.calls[0] == ("start", 4) and prop.calls[-1] == ("finish",)
    extended = [t for c in prop.calls if c[0] == "extend" for t in c[1]]
    assert extended == out[1:len(extended) + 1]  # accepted tokens plus the target's, in order
    assert st["tokens"] == 19 and st["accepted"] + st["steps"] >= 19
    # Position j+1 is only ever accepted after position j: the counts cannot grow.
    assert all(a >= b for a, b in zip(st["per_pos"], st["per_pos"][1:])) and st["per_pos"][0] > 0
    alphas = tune.conditional_acceptance(st["per_pos"], st["drafts"])
    assert 0 < alphas[0] < 1 and alphas[1] == pytest.approx(1.0)

"""`qpcbuild bench` and `qpcbuild tune`: the report's contents on a tiny bundle of the demo pair
(peers forced missing); tune's model, cost model and recipe rewriting as pure functions; the
engine's replay API against real speculative decoding (the oracle, which also rejects broken
replays); where costs come from, recorded in the recipe comment and the manifest."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild import bench, tune
from qpcbuild.cli import app
from qpcbuild.errors import UsageError
from qpcbuild.recipe import load_recipe, recipe_from_text
from qpcbuild.runtime.replay import replay as engine_replay
from qpcbuild.runtime.sampling import SamplingParams

from helpers_engine import EOS, Scripted, decoder
from helpers_tune import made_decision

ROOT = Path(__file__).resolve().parents[1]
# QPCBUILD_TEST_DEMO: another folder holding target/ and draft/ of the same shapes (for
# development while models/demo is being trained).
DEMO = Path(os.environ.get("QPCBUILD_TEST_DEMO") or ROOT / "models" / "demo")
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
    # the same by counting drafts by how many of their tokens were accepted: 20 none, 40 one,
    # 30 two, 10 three: (40 + 60 + 30) / 100 = 1.3 accepted, plus the target's own token
    assert tune.expected_tokens(alphas, 3) == pytest.approx(1 + (40 * 1 + 30 * 2 + 10 * 3) / 100)
    assert tune.expected_tokens(alphas, 5) == pytest.approx(2.3)  # no evidence beyond 3: 0
    assert tune.all_accepted(alphas, 2) == pytest.approx(0.4)
    assert tune.conditional_acceptance([0, 0], 0) == [0.0, 0.0]


def test_predict_draft_model_cost_by_hand():
    alphas = [0.8, 0.5]
    t_verify = {0: 1e-3, 1: 1.2e-3, 2: 1.5e-3}
    rows = tune.predict("draft_model", alphas, 0.1e-3, t_verify, 0.05e-3, 1.0, [1, 2],
                        host_target_only=0.05e-3)
    r1, r2 = rows
    # Target-only: 1 token per 1.0 + 0.05 ms = 952.38 tokens/s.
    # K=1: E = 1 + .8 = 1.8; draft 1 step + a catch-up step when it was accepted (p .8):
    # 1.8 x 0.1 = 0.18 ms; cost 0.18 + 1.2 + 0.05 = 1.43 ms; 1.8 / 1.43 ms = 1258.74 tokens/s,
    # x 1.05 / 1 ms = 1.8 x 1.05 / 1.43 = 1.3217 over target-only.
    assert r1["expected_tokens_per_step"] == pytest.approx(1.8)
    assert r1["draft_ms"] == pytest.approx(0.18, abs=1e-4)
    assert r1["cost_ms"] == pytest.approx(1.43, abs=1e-4)
    assert r1["tokens_per_s"] == pytest.approx(1258.74, abs=0.01)
    assert r1["predicted_speedup"] == pytest.approx(1.322, abs=1e-3)
    # K=2: E = 1 + .8 + .8 x .5 = 2.2; catch-up probability .4: (2 + .4) x 0.1 = 0.24 ms;
    # cost 0.24 + 1.5 + 0.05 = 1.79 ms; 2.2 / 1.79 ms = 1229.05 tokens/s; 2.2 x 1.05 / 1.79 =
    # 1.2905. K=1 wins: K=2's 0.4 more tokens (+22%) cost 0.36 ms more (+25%).
    assert r2["expected_tokens_per_step"] == pytest.approx(2.2)
    assert r2["draft_ms"] == pytest.approx(0.24, abs=1e-4)
    assert r2["cost_ms"] == pytest.approx(1.79, abs=1e-4)
    assert r2["tokens_per_s"] == pytest.approx(1229.05, abs=0.01)
    assert r2["predicted_speedup"] == pytest.approx(1.2905, abs=1e-3)
    assert r2["vs_best"] == pytest.approx(1229.05 / 1258.74 - 1, abs=1e-4)  # -2.4%
    assert tune.choose_k(rows) == 1
    # K draft steps measured together (a dict): K=2's two steps take 0.25 ms, and the catch-up
    # call costs one step's share, 0.25 / 2, with probability .4: 0.25 x (1 + .4 / 2) = 0.30 ms.
    per_k = tune.predict("draft_model", alphas, {1: 0.1e-3, 2: 0.25e-3}, t_verify, 0.05e-3,
                         1.0, [1, 2], host_target_only=0.05e-3)
    assert [r["draft_ms"] for r in per_k] == pytest.approx([0.18, 0.30], abs=1e-4)
    assert per_k[1]["cost_ms"] == pytest.approx(1.85, abs=1e-4)  # 0.30 + 1.5 + 0.05


def test_predict_model_free_counts_steps_without_a_proposal():
    rows = tune.predict("ngram", [1.0], None, {0: 1e-3, 1: 2e-3}, 0.0, 0.5, [1])
    # half the steps: 2 tokens at 2 ms; the other half: 1 token at 1 ms. 1.5 tokens per 1.5 ms
    # is 1000 tokens/s, what target-only does (1 per 1 ms): break-even, speedup 1.
    assert rows[0]["expected_tokens_per_step"] == pytest.approx(1.5)
    assert rows[0]["cost_ms"] == pytest.approx(1.5)
    assert rows[0]["tokens_per_s"] == pytest.approx(1000.0)
    assert rows[0]["predicted_speedup"] == pytest.approx(1.0)
    # 0.5 ms of host time per step on both sides: 1.5 tokens per 2.0 ms = 750 tokens/s against
    # 1 per 1.5 ms = 666.67: the fixed host time dilutes the cost of the wider window, 1.125x.
    # Proposals on 80% of the steps with alpha .5 and K=2: E = 1 + .5 + .25 = 1.75, tokens
    # .8 x 1.75 + .2 = 1.6 per .8 x 3 + .2 x 1 = 2.6 ms (no host time).
    host = tune.predict("ngram", [1.0], None, {0: 1e-3, 1: 2e-3}, 0.5e-3, 0.5, [1])
    assert host[0]["tokens_per_s"] == pytest.approx(750.0)
    assert host[0]["predicted_speedup"] == pytest.approx(1.125)
    two = tune.predict("suffix", [0.5, 0.5], None, {0: 1e-3, 2: 3e-3}, 0.0, 0.8, [2])
    assert two[0]["expected_tokens_per_step"] == pytest.approx(1.6)
    assert two[0]["cost_ms"] == pytest.approx(2.6)
    assert two[0]["tokens_per_s"] == pytest.approx(1.6 / 2.6e-3, abs=0.01)  # 615.38


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


@pytest.mark.parametrize("recipe", ["recipes/demo.yaml", "recipes/demo-ngram.yaml"])
def test_write_produces_a_recipe_that_load_recipe_accepts_with_the_chosen_k(tmp_path, recipe):
    out = tune.write_tuned_recipe(ROOT / recipe, made_decision(3, load_recipe(ROOT / recipe)
                                                              .draft.method),
                                  tmp_path / "sub" / "tuned.yaml")
    r = load_recipe(out)
    orig = load_recipe(ROOT / recipe)
    before = orig.speculation.num_speculative_tokens
    keep_zero = isinstance(before, list) and before == [0, 4]  # K=0 baselines stay compiled
    assert r.speculation.num_speculative_tokens == ([0, 3] if keep_zero else 3)
    assert r.ks == ((0, 3) if keep_zero else tuple(tune.recommended_ks(orig.draft.method, 3)))
    # the copy points at the same model folders and keeps every other setting
    assert Path(r.source_dir() / r.target.model).resolve() == \
        Path(orig.source_dir() / orig.target.model).resolve()
    assert r.shapes == orig.shapes and r.hardware == orig.hardware
    text = out.read_text()
    assert text.count(tune.TUNE_MARK) >= 3 and "K=3 chosen by `qpcbuild tune`" in text
    # in place, twice: the second evidence replaces the first
    inplace = tmp_path / "inplace.yaml"
    inplace.write_text((ROOT / recipe).read_text().replace("../models", str(ROOT / "models")))
    tune.write_tuned_recipe(inplace, made_decision(2, orig.draft.method))
    tune.write_tuned_recipe(inplace, made_decision(1, orig.draft.method))
    again = inplace.read_text()
    assert load_recipe(inplace).speculation.num_speculative_tokens == ([0, 1] if keep_zero else 1)
    assert again.count("chosen by `qpcbuild tune`") == 1
    # every other line is kept; ruamel only normalises spacing inside a line (`draft:  {`)
    kept = [" ".join(x.split()) for x in (ROOT / recipe).read_text().splitlines()
            if "num_speculative_tokens" not in x and "model:" not in x]
    got = {" ".join(x.split()) for x in again.splitlines()}
    assert all(line in got for line in kept)


def test_set_k_handles_block_lists_flow_maps_and_a_missing_speculation_section():
    base = "schema: 1\nname: x\ntarget:\n  model: /nonexistent/t\ndraft:\n  method: ngram\n"
    # K replaces a list's largest K; its other Ks below K stay (K=0 for target-only baselines,
    # a ladder of verify windows), those above go; nothing left below K gives a plain K.
    for text, want, line in (
            (base + "speculation:\n  num_speculative_tokens:\n    - 0\n    - 4\n", [0, 5], "[0, 5]"),
            (base + "speculation:\n  num_speculative_tokens: [0,\n    4]\n", [0, 5], "[0, 5]"),
            (base + "speculation:\n  num_speculative_tokens: [3, 4]\n", [3, 5], "[3, 5]"),
            (base + "speculation:\n  num_speculative_tokens: [0, 1, 2, 4, 8]\n", [0, 1, 2, 4, 5],
             "[0, 1, 2, 4, 5]"),
            (base + "speculation:\n  num_speculative_tokens: [6, 8]\n", 5, "5"),
            (base + "speculation: {num_speculative_tokens: 2}  # inline\n", 5, "5"),
            (base + "shapes:\n  ctx_len: 512\n", 5, "5")):
        out = tune.set_k_in_text(text, "ngram", 5, ["# tune: evidence"])
        assert recipe_from_text(out).speculation.num_speculative_tokens == want
        assert f"  # tune: evidence\n  num_speculative_tokens: {line}" in out


def _comments(text: str) -> list[str]:
    return [line[line.index("#"):].strip() for line in text.splitlines() if "#" in line]


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_ruamel_round_trip_keeps_comments_and_changes_only_k(recipe):
    import yaml

    text = (ROOT / "recipes" / recipe).read_text()
    method = yaml.safe_load(text)["draft"]["method"]
    out = tune.set_k_in_text(text, method, 5, ["# tune: first line", "# tune: second line"])
    # every comment of the recipe is still there, except the one that described the old K and
    # an earlier tune's evidence (which the new evidence replaces)
    k_line = next(x for x in text.splitlines() if "num_speculative_tokens" in x)
    old_k_comment = _comments(k_line)
    assert [c for c in _comments(text) if c not in old_k_comment
            and not c.startswith(("# tune:", "# tuned"))] == \
        [c for c in _comments(out) if not c.startswith(("# tune:", "# tuned"))]
    # the data differ in K only
    before, after = yaml.safe_load(text), yaml.safe_load(out)
    old_k = before["speculation"].pop("num_speculative_tokens")
    below = sorted(x for x in old_k[:-1] if x < 5) if isinstance(old_k, list) else []
    assert after["speculation"].pop("num_speculative_tokens") == (below + [5] if below else 5)
    assert before == after
    # a second run replaces the evidence instead of adding to it
    again = tune.set_k_in_text(out, method, 2, ["# tune: newer"])
    below = [x for x in below if x < 2]  # the second run replaces 5, the largest
    assert again.count("# tune:") == 1 and yaml.safe_load(again)["speculation"][
        "num_speculative_tokens"] == (below + [2] if below else 2)


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


@pytest.mark.slow
def test_peers_find_the_recipes_checkpoints_although_the_bundle_records_no_paths(tmp_path):
    """A bundle names its models by reference only; bench given the recipe hands the peers
    the recipe's folders, and transformers then runs and reproduces our greedy tokens."""
    from qpcbuild.bench.measure import _local_models

    recipe = ROOT / "recipes" / "demo.yaml"
    report, _, _ = bench.bench(recipe, ks=[1], methods=["draft_model"], num_prompts=1,
                               prompt_set="code", max_new_tokens=8, repeats=1,
                               peers=("transformers",), peer_ks=[1], cache_dir=tmp_path / "c",
                               bundle_out=tmp_path / "b", json_out=tmp_path / "r.json",
                               plot=False)
    peer = report["peers"]["transformers"]
    assert peer["status"] == "ok", peer
    assert _local_models(recipe, [], tmp_path / "b") == {
        "target": (ROOT / "models/demo/target").resolve(),
        "draft": (ROOT / "models/demo/draft").resolve()}


def test_bench_repeats_alternate_the_order_of_configurations(tiny_bundle, monkeypatch):
    """No configuration runs first in every measured pass: repeats go forward and in reverse by
    turns (the warm-up and repeat 1 forward)."""
    _no_peers(monkeypatch)
    lines: list[str] = []
    prompts = bench.load_prompts(prompt_set="code", limit=1)[1]
    bench.run_bench(tiny_bundle, prompts, ks=[1], methods=["draft_model", "ngram"],
                    max_new_tokens=4, repeats=3, say=lines.append)
    passes: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith(("warm-up qpcbuild ", "repeat ")):
            head, label = line.split(" qpcbuild ", 1)
            passes.setdefault(head, []).append(label.split(":")[0])
    forward = ["target-only", "draft_model K=1", "ngram K=1"]
    assert passes == {"warm-up": forward, "repeat 1/3": forward,
                      "repeat 2/3": forward[::-1], "repeat 3/3": forward}


def test_bench_report_rows_speedups_greedy_and_plot(tiny_bundle, tmp_path, monkeypatch):
    _no_peers(monkeypatch)
    prompts = bench.load_prompts(prompt_set="code", limit=2)[1]
    report = bench.run_bench(tiny_bundle, prompts, prompt_label="code", ks=[1, 2],
                             max_new_tokens=16, repeats=1, cache_dir=tmp_path / "cache")
    rows = report["rows"]
    assert rows[0]["method"] == "target_only" and rows[0]["k"] == 0
    got = {(r["method"], r["k"]) for r in rows[1:]}
    assert got == {(m, k) for m in ("draft_model", "ngram", "suffix") for k in (1, 2)}
    base_s = rows[0]["seconds_per_repeat"][0]
    for r in rows:
        assert r["tokens_per_s"]["mean"] > 0
        # every row makes the same 2 x 16 tokens in one repeat: the speedup is the inverse
        # ratio of the wall times (recorded to 0.1 ms)
        assert r["speedup"]["mean"] == pytest.approx(base_s / r["seconds_per_repeat"][0],
                                                     rel=1e-2)
        assert r["greedy_matches_target_only"] is True
        assert r["new_tokens_per_repeat"] == 2 * 16
    assert report["all_greedy_outputs_match"] is True
    # the report names the code that ran (this checkout: git's own description of it) and no
    # folder of this machine
    described = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert report["code_version"] == described
    text = json.dumps(report, default=str)
    assert str(tmp_path) not in text and str(Path(tiny_bundle).resolve().parent) not in text
    assert not Path(report["bundle"]).is_absolute()
    spd = [r for r in rows if r["method"] == "draft_model"]
    assert all(0 <= r["acceptance_rate"] <= 1 and r["ideal_speedup"] > 0 for r in spd)
    assert all(len(r["acceptance_per_position"]) == r["k"] for r in spd)
    for name in ("transformers", "onnxruntime-genai"):
        assert report["peers"][name]["status"] == "skipped"
        assert "not installed" in report["peers"][name]["note"]
    # the peers that need a build are not the package's: bench's report leaves them out
    assert set(report["peers"]) == {"transformers", "onnxruntime-genai"}
    # the CLI's default --peers is the same list
    import inspect
    from qpcbuild.cli.measure import bench as bench_cmd
    assert inspect.signature(bench_cmd).parameters["peers"].default.default == \
        ",".join(bench.DEFAULT_PEERS)
    assert "goals" not in report  # a user's report holds their results, not ours
    path = bench.write_json(report, tmp_path / "r.json")
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(rows))
    png = bench.plot_report(report, tmp_path / "r.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "| draft_model | 2 |" in bench.markdown_table(report)
    bw = report["target_only_bandwidth"]
    # Oracle for the graph's weight bytes: the checkpoint's own tensors (float32), the tied
    # embedding counted once, as the LM head's MatMul (the Gather reads one row per token).
    from safetensors import safe_open
    with safe_open(str(DEMO / "target" / "model.safetensors"), "np") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert bw["weights_mb"] == pytest.approx(params * 4 / 1e6, rel=1e-3)
    # Bytes per token: those weights, one embedding row (256 x 4 bytes) and the float32 KV,
    # 2 x 6 layers x 2 heads x 32 x 4 bytes = 3,072 per position, at the mean context: the
    # prompts' mean length plus half of the 16 new tokens. At the target-only decode rate (the
    # row's), in GB/s (1e9 bytes).
    from qpcbuild.runtime.loader import load
    tokenizer = load(tiny_bundle)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    positions = sum(map(len, prompt_ids)) / len(prompt_ids) + 16 / 2
    assert bw["mean_valid_positions"] == pytest.approx(positions, abs=0.05)
    per_token = params * 4 + 256 * 4 + 3_072 * positions
    assert bw["bytes_per_token_mb"] == pytest.approx(per_token / 1e6, abs=0.006)
    assert bw["decode_tokens_per_s"] == rows[0]["decode_tokens_per_s"]
    achieved = per_token * rows[0]["decode_tokens_per_s"] / 1e9
    assert bw["achieved_gbs"] == pytest.approx(achieved, rel=1e-2)
    assert bw["probe"]["gbs"] > 0 and bw["fraction_of_probe"] == pytest.approx(
        achieved / bw["probe"]["gbs"], rel=1e-2)
    assert "GB/s" in bench.markdown_table(report)
    assert report["machine"]["threads"]["qpcbuild_target"] == bw["probe"]["threads"] >= 1


def test_graph_bytes_counts_indexed_tables_by_row(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from qpcbuild.bench.bandwidth import graph_bytes
    table = numpy_helper.from_array(np.zeros((100, 8), np.float32), "table")
    weight = numpy_helper.from_array(np.zeros((8, 16), np.float16), "w")
    both = numpy_helper.from_array(np.zeros((100, 8), np.float32), "both")  # gathered AND matmul'd
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Gather", ["both", "ids"], ["e2"]),
             helper.make_node("Add", ["e", "e2"], ["s"]),
             helper.make_node("MatMul", ["s", "w"], ["y"]),
             helper.make_node("MatMul", ["x", "both"], ["z"], name="reads_all_of_both")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 100])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [table, weight, both])
    onnx.save(helper.make_model(graph), tmp_path / "g.onnx")
    got = graph_bytes(tmp_path / "g.onnx")
    assert got == {"full_bytes": 8 * 16 * 2 + 100 * 8 * 4, "indexed_row_bytes": 8 * 4}


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


def _assert_chosen_is_the_fastest(chosen_k: int, table: list[dict]) -> None:
    """No row of the evidence is faster than the chosen K, and none as fast has a smaller K."""
    chosen = next(row for row in table if row["k"] == chosen_k)
    for row in table:
        assert row["tokens_per_s"] <= chosen["tokens_per_s"], (chosen_k, table)
        if row["tokens_per_s"] == chosen["tokens_per_s"]:
            assert row["k"] >= chosen_k, (chosen_k, table)


def _assert_per_batch_choice(chosen_k: int, table: list[dict]) -> None:
    """A batch size's K: the fastest row, unless none is predicted to beat not speculating
    (K=0) by the gate's margin; then K=0, even where a K is predicted a little faster."""
    from qpcbuild.runtime.gate import DEFAULT

    if chosen_k:
        _assert_chosen_is_the_fastest(chosen_k, table)
        assert next(r for r in table if r["k"] == chosen_k)["predicted_speedup"] >= 1 + DEFAULT.margin
    else:
        assert all(r["predicted_speedup"] < 1 + DEFAULT.margin for r in table), table


def test_tune_measures_and_writes_a_recipe(tmp_path):
    result = tune.tune(ROOT / "recipes" / "demo.yaml", demo_overrides(), k_max=2, num_prompts=2,
                       max_new_tokens=16, rounds=3, cache_dir=tmp_path / "cache")
    assert result.chosen_k in (1, 2)
    record = result.to_json()  # what `tune --json` prints, the rows as dicts
    assert [r["k"] for r in record["table"]] == [1, 2]
    _assert_chosen_is_the_fastest(result.chosen_k, record["table"])
    assert record["predicted_tokens_per_s"] == result.chosen.tokens_per_s
    cal = result.evidence.calibration
    for row in result.table:  # E(K) = 1 + sum of P(first i accepted) = accepted_i / drafts
        shares = cal["by_k"][row.k]["acceptance_per_position"]
        assert row.expected_tokens_per_step == pytest.approx(1 + sum(shares[:row.k]), abs=1e-3)
    assert len(cal["alpha"]) == 2 and cal["num_drafts"] > 0
    assert set(result.evidence.costs["verify_ms"]) == {0, 1, 2}
    for check in result.evidence.model_check[1:]:  # greedy: the replayed loop is the real loop
        assert check.accepted_replayed == check.accepted_measured
        assert check.drafts_replayed == check.drafts_measured
    # the costs say where they come from: this recipe runs on ONNX Runtime, timed here
    assert result.cost_source == "onnxruntime-cpu" and result.costs_measured
    costs = result.evidence.costs
    assert costs["statistic"] == "lower quartile" and costs["rounds"] == 3
    assert result.run is not None and "exact float32" in result.run.acceptance_measured_on
    # the JSON record keeps the keys (and their order) tune has always printed
    assert list(record)[:13] == ["tool", "recipe", "name", "overrides", "created", "prompt_set",
                                 "machine", "recipe_k", "cost_source", "acceptance_measured_on",
                                 "notes", "method", "k_max"]
    assert json.loads(json.dumps(record, default=str))["chosen_k"] == result.chosen_k
    out = tune.write_tuned_recipe(ROOT / "recipes" / "demo.yaml", result, tmp_path / "t.yaml")
    # demo.yaml compiles K=0 for target-only baselines: the tuned copy keeps it
    assert load_recipe(out).speculation.num_speculative_tokens == [0, result.chosen_k]
    text = out.read_text()
    assert "# tune: costs: onnxruntime-cpu (measured on ONNX Runtime on this CPU, lower " \
        "quartile of 3 rounds" in text
    assert "# tune: acceptance measured on ONNX Runtime, exact float32" in text


@pytest.mark.slow
def test_compile_tune_builds_with_the_chosen_k_and_records_the_evidence(tmp_path):
    from qpcbuild.bundle import read_manifest

    out = tmp_path / "bundle"
    # (--tune-force: this checks the build; the refusal of a contradicted K is tested on its
    # own in test_new_user.py, as a busy runner cannot be summoned on demand)
    args = ["compile", str(ROOT / "recipes" / "demo.yaml"), "--tune", "--tune-force", "-o",
            str(out), "--cache-dir", str(tmp_path / "cache"), "--json"]
    for o in demo_overrides():
        args += ["--set", o]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    m = read_manifest(out).to_json_dict()
    # demo.yaml compiles [0, 4]: the tuned K replaces 4 and K=0 stays, as `tune --write` keeps it
    assert m["speculation"]["num_speculative_tokens"] == sorted({0, m["tuning"]["chosen_k"]})
    assert m["tuning"]["table"] and m["tuning"]["calibration"]["num_drafts"] > 0
    assert m["tuning"]["cost_source"] == "onnxruntime-cpu"


# ---------------------------------------------------------------- the engine's replay API
def _totals(rows, times) -> dict:
    """Per-position acceptance and call counts of a set of rows, as the oracle compares them."""
    width = max((len(r.stats.accepted_per_pos) for r in rows), default=0)
    return {"per_pos": [sum(r.stats.accepted_per_pos[j] for r in rows
                            if j < len(r.stats.accepted_per_pos)) for j in range(width)],
            "drafts": sum(r.stats.num_drafts for r in rows),
            "draft_tokens": sum(r.stats.num_draft_tokens for r in rows),
            "accepted": sum(r.stats.num_accepted_tokens for r in rows),
            "steps": sum(r.stats.target_calls for r in rows),
            "target_calls": times.target_calls, "draft_calls": times.draft_calls,
            "tokens": [r.tokens for r in rows]}


def _disagreements(real: dict, replayed: dict) -> list[str]:
    return [key for key in real if real[key] != replayed[key]]


def test_replay_on_a_toy_model_equals_the_real_loop():
    """A target whose greedy next token is token + 1 (an EOS at 5 ends some rows) and a proposer
    that is right, then wrong: replaying the known outputs counts exactly what running does."""
    for proposal, prompt in (([3, 4, 9, 9], [1, 2]), ([8, 9, 10, 11], [6, 7]),
                             ([9, 10, 1, 12], [7, 8])):
        for k in (1, 2, 4):
            d = decoder(Scripted(proposal), ks=(0, 1, 2, 4))
            base, _ = d.generate([prompt], 12, SamplingParams(), target_only=True)
            out = base[0].tokens[len(prompt):]
            assert (EOS in out) == (prompt[0] < 5)
            rows, times = d.generate([prompt], 12, SamplingParams(), k=k)
            real = _totals(rows, times)
            rows, times = engine_replay(d, [prompt], [out], 12, k)
            assert _disagreements(real, _totals(rows, times)) == []


@pytest.mark.parametrize("method", ["draft_model", "ngram", "suffix"])
def test_engine_replay_equals_real_spd_on_the_demo_pair_and_rejects_broken_replays(
        tiny_bundle, method, monkeypatch):
    """The oracle: real speculative decoding on the demo pair at each K (the target model runs)
    against the engine's `replay` and tune's `replayed` over the target-only greedy outputs."""
    from qpcbuild.runtime import replay
    from qpcbuild.runtime.loader import load

    gen = load(tiny_bundle, method="draft_model", verify="fast").sibling(method)
    prompts = [gen.encode(p) for p in bench.load_prompts(prompt_set="code", limit=3)[1]]
    max_new = 24
    base = gen.sibling(target_only=True)
    outputs = [base.generate([p], max_new, target_only=True).rows[0].tokens[len(p):]
               for p in prompts]
    for k in (1, 2):
        gen.fresh_proposer()
        runs = [gen.generate([p], max_new, k=k) for p in prompts]
        real = {"per_pos": [sum(x) for x in zip(*[
                    list(r.stats.accepted_per_pos) + [0] * (k - len(r.stats.accepted_per_pos))
                    for r in runs])],
                "drafts": sum(r.stats.num_drafts for r in runs),
                "draft_tokens": sum(r.stats.num_draft_tokens for r in runs),
                "accepted": sum(r.stats.num_accepted_tokens for r in runs),
                "target_calls": sum(r.stats.target_calls for r in runs),
                "draft_calls": sum(r.stats.draft_calls for r in runs),
                "tokens": [row.tokens for r in runs for row in r.rows]}
        assert real["drafts"] > 0 and any(real["per_pos"])
        got = _totals(*engine_replay(gen.sibling(method).decoder, prompts, outputs, max_new, k))
        got["per_pos"] += [0] * (k - len(got["per_pos"]))
        got.pop("steps")
        assert _disagreements(real, got) == []
        sim = tune.replayed(gen, prompts, outputs, max_new, k)  # what tune uses
        assert (sim["per_pos"], sim["drafts"], sim["accepted"], sim["draft_calls"]) == \
            (real["per_pos"], real["drafts"], real["accepted"], real["draft_calls"])
        # Broken replays are rejected: one that counts each acceptance at the next position,
        # and one whose target answers one position late (each draft compared with the token
        # after the right one).
        shifted = dict(got, per_pos=[0] + got["per_pos"][:-1])
        assert "per_pos" in _disagreements(real, shifted)
        good_next = replay.KnownTarget._next

        def off_by_one(self, seq, p):
            try:
                return good_next(self, seq, p + 1)
            except UsageError:
                return seq[-1]

        monkeypatch.setattr(replay.KnownTarget, "_next", off_by_one)
        broken = _totals(*engine_replay(gen.sibling(method).decoder, prompts, outputs, max_new, k))
        broken["per_pos"] += [0] * (k - len(broken["per_pos"]))
        broken.pop("steps")
        assert _disagreements(real, broken) != []
        monkeypatch.undo()


def test_replay_refuses_an_output_that_is_too_short():
    d = decoder(Scripted([9, 9]), ks=(0, 2))
    with pytest.raises(UsageError, match="past the given output"):
        engine_replay(d, [[6, 7]], [[8, 9]], 8, 2)  # 8 new tokens asked, 2 known, no EOS


# ---------------------------------------------------------------- tune: the cost model
def test_roofline_costs_follow_from_the_assumptions_by_hand():
    r = load_recipe(ROOT / "recipes" / "demo.yaml",
                    demo_overrides() + ["backends=[qaic]", "precision.quantization=mxfp6",
                                        "precision.kv_cache_dtype=mxint8"])
    fig = {"card": "test", "dram_gbs_per_qid": 100.0, "fp16_tflops_per_qid": 50.0,
           "source": "test"}
    t_verify, t_draft, detail = tune.roofline_costs(r, [1, 2], position=100, batch=1, fig=fig)
    # Demo target (config.json): H 256, 6 layers, 8 heads, 2 KV heads, head_dim 32, I 688,
    # V 4096, tied. Per layer 256*256 + 2*256*64 + 256*256 + 3*256*688 + 2*256 = 692,736;
    # params 6 * 692,736 + 4096*256 + 256 = 5,205,248, all of them MatMul weights (and norms) in
    # the graph, the tied head included: 5,205,248 * 25/32 = 4,066,600 bytes, plus the fp16
    # embedding row of each token (256 * 2 = 512 bytes), not the whole table.
    # KV: 2 * 6 * 2 * 32 * 33/32 = 792 bytes per token; K=2 at position 100: 103 tokens.
    assert detail["target_call"]["weight_bytes"] == pytest.approx(4_066_600 + 512)  # K=0
    assert t_verify[2] == pytest.approx((4_066_600 + 3 * 512 + 792 * 103) / 100e9)  # memory bound
    assert detail["verify_bound"][2] == "memory"
    assert 2 * 5_205_248 * 3 / 50e12 < t_verify[2]  # the compute roof is lower here
    # Demo draft: H 128, 2 layers, 4 heads, 2 KV heads, I 344, tied: per layer 181,504;
    # params 887,424: 887,424 * 25/32 = 693,300 bytes + one embedding row of 256 bytes;
    # KV 2 * 2 * 2 * 32 * 33/32 = 264 bytes per token, 101 tokens for one step at 100.
    step = (693_300 + 256 + 264 * 101) / 100e9
    assert detail["draft_step_ms"] == pytest.approx(step * 1e3, abs=1e-6)
    assert t_draft[2] == pytest.approx(2 * step)
    # batch 128 at position 0: the compute roof takes over for the target's verify of 3 tokens
    # (2 * 5,205,248 * 3 * 128 FLOPs = 80 us at 50 TFLOPS; 4,066,600 + (512 + 792) * 3 * 128
    # bytes = 41 us at 100 GB/s)
    tc, _, dc = tune.roofline_costs(r, [2], position=0, batch=128, fig=fig)
    assert dc["verify_bound"][2] == "compute"
    assert tc[2] == pytest.approx(2 * 5_205_248 * 3 * 128 / 50e12)
    assert (4_066_600 + (512 + 792) * 3 * 128) / 100e9 < tc[2]
    # the published table: Ultra 548 GB/s and 290 TFLOPS over 4 QIDs
    pub = tune.roofline_figures(r)
    assert (pub["dram_gbs_per_qid"], pub["fp16_tflops_per_qid"]) == (137.0, 72.5)
    assert "Architecture" in pub["source"]
    assert tune.roofline_figures(r, 50.0)["source"].startswith("given on the command line")
    ai200 = load_recipe(ROOT / "recipes" / "demo.yaml",
                        demo_overrides() + ["hardware.aic_hw_version=ai200"])
    with pytest.raises(UsageError, match="--card-bandwidth-gbs"):
        tune.roofline_figures(ai200)


def test_roofline_reads_an_untied_head_and_only_a_drafts_subset_rows(tmp_path):
    # The demo pair with its target untied (a head of its own beside the embedding) and a draft
    # vocabulary subset of 1,000 tokens, at fp16 (2 bytes per weight).
    from safetensors.numpy import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(DEMO / "target", target)
    tensors = load_file(target / "model.safetensors")
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].copy()},
              target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    (tmp_path / "subset.json").write_text(json.dumps({"token_ids": list(range(1000))}))
    r = load_recipe(ROOT / "recipes" / "demo.yaml",
                    [f"target.model={target}", f"draft.model={DEMO / 'draft'}",
                     f"draft.vocab_subset={tmp_path / 'subset.json'}", "backends=[qaic]",
                     "precision.quantization=none", "precision.kv_cache_dtype=float16"])
    fig = {"card": "test", "dram_gbs_per_qid": 100.0, "fp16_tflops_per_qid": 50.0,
           "source": "test"}
    _, _, detail = tune.roofline_costs(r, [1], position=0, batch=1, fig=fig)
    # Untied target: 6 layers * 692,736 + final norm 256 + a head of 4096 * 256 = 5,205,248
    # MatMul parameters (the separate 4096 x 256 embedding table is gathered: one row per token).
    assert detail["target_call"]["weight_bytes"] == pytest.approx(5_205_248 * 2 + 512)
    assert detail["target_call"]["flops"] == pytest.approx(2 * 5_205_248)
    # Draft: 2 layers * 181,504 + norm 128 = 363,136, and a head of 1,000 (not 4,096) rows of 128.
    assert detail["draft_call"]["weight_bytes"] == pytest.approx((363_136 + 128_000) * 2 + 256)
    # The plan's memory estimate keeps the whole fp16 table resident beside the MatMul weights.
    from qpcbuild.plan import make_plan

    draft_gib = make_plan(r).role("draft").memory.weights_gib
    assert draft_gib == pytest.approx(((363_136 + 128_000) * 2 + 4096 * 128 * 2) / 2**30)


def test_tune_cost_model_prints_and_records_its_assumptions(tmp_path):
    from io import StringIO

    from rich.console import Console

    result = tune.tune(ROOT / "recipes" / "demo.yaml", demo_overrides(), k_max=2, num_prompts=1,
                       max_new_tokens=16, cache_dir=tmp_path / "cache", cost_model=True)
    assert result.cost_source == "roofline-model" and not result.costs_measured
    costs = result.evidence.costs
    assert costs["assumptions"] == tune.ROOFLINE_ASSUMPTIONS
    assert costs["figures"]["dram_gbs_per_qid"] == 137.0
    # The decision's numbers by hand, from the assumptions (the demo recipe is float16 weights
    # and KV on one QID at 137 GB/s; host time 0). Target: 5,205,248 params (see the test above)
    # x 2 bytes = 10,410,496 bytes, + 512 bytes of embedding per token; KV 2 x 6 layers x 2 heads
    # x 32 x 2 bytes = 1,536 per token. Draft: 887,424 x 2 = 1,774,848 bytes + 256 per token; KV
    # 2 x 2 x 2 x 32 x 2 = 512 per token. Memory bound (a 3-token verify is 2 x 5,205,248 x 3
    # FLOPs = 0.43 us at 72.5 TFLOPS, against ~76 us).
    pos, bw = costs["position"], 137e9
    verify_s = {k: (10_410_496 + 512 * (k + 1) + 1_536 * (pos + k + 1)) / bw for k in (0, 1, 2)}
    step_s = (1_774_848 + 256 + 512 * (pos + 1)) / bw
    # the recorded costs (6 decimals of a ms: one KV token, 1,536 bytes, is 1.1e-5 ms)
    assert costs["verify_ms"] == pytest.approx({k: t * 1e3 for k, t in verify_s.items()},
                                               abs=2e-6)
    assert costs["draft_step_ms"] == pytest.approx(step_s * 1e3, abs=2e-6)
    by_k = result.evidence.calibration["by_k"]
    for row in result.to_json()["table"]:
        k = row["k"]
        # P(first i drafts accepted) = accepted at position i / drafts (the product of the
        # conditional alphas telescopes), so E(K) = 1 + the sum of those shares
        shares = by_k[k]["acceptance_per_position"]
        tokens = 1 + sum(shares[:k])
        draft_s = (k + shares[k - 1]) * step_s  # K steps, + a catch-up step when all accepted
        rate = tokens / (draft_s + verify_s[k])
        assert row["expected_tokens_per_step"] == pytest.approx(tokens, abs=1e-3)
        assert row["verify_ms"] == pytest.approx(verify_s[k] * 1e3, abs=1e-4)
        assert row["draft_ms"] == pytest.approx(draft_s * 1e3, abs=1e-4)
        assert row["host_ms"] == 0
        assert row["tokens_per_s"] == pytest.approx(rate, rel=2e-3)
        assert row["predicted_speedup"] == pytest.approx(rate * verify_s[0], rel=2e-3)
    assert all(row.tokens_per_s <= result.chosen.tokens_per_s for row in result.table)
    buf = StringIO()
    tune.show_tune(result, Console(file=buf, width=300, force_terminal=True, color_system=None,
                                   highlight=False))
    shown = buf.getvalue()
    assert "roofline-model" in shown and all(a[:40] in shown for a in tune.ROOFLINE_ASSUMPTIONS)
    out = tune.write_tuned_recipe(ROOT / "recipes" / "demo.yaml", result, tmp_path / "t.yaml")
    text = out.read_text()
    assert "# tune: costs: roofline-model of cloud-ai-100-ultra (137 GB/s" in text
    assert text.count("# tune:   assumed:") == len(tune.ROOFLINE_ASSUMPTIONS)


# ---------------------------------------------------------------- tune: --per-batch
def test_best_k_per_batch_is_the_argmax_of_each_batch_table_with_k0_a_candidate():
    # rates per K and the target-only rate they are predicted against
    def rows(rates, plain):
        return [{"k": k, "tokens_per_s": t, "cost_ms": 1.0, "predicted_speedup": t / plain}
                for k, t in rates.items()]
    out = tune.best_k_per_batch({4: rows({1: 90.0, 2: 80.0}, 85.0),
                                 1: rows({1: 100.0, 2: 120.0}, 60.0),
                                 8: rows({1: 30.0, 2: 35.0}, 50.0),
                                 6: rows({1: 51.0}, 50.0)})  # 2% ahead: inside the margin
    assert [(p["batch_size"], p["chosen_k"]) for p in out] == [(1, 2), (4, 1), (6, 0), (8, 0)]
    assert out[1]["tokens_per_s_batch"] == pytest.approx(360.0)
    assert out[3]["tokens_per_s_per_sequence"] == pytest.approx(50.0)  # not speculating
    assert [r["k"] for r in out[3]["table"]] == [0, 1, 2]


def test_tune_per_batch_reports_records_and_serve_config_comments(tmp_path, peer_manifest):
    from qpcbuild.cli.serve_config import host_setup

    result = tune.tune(ROOT / "recipes" / "demo.yaml", demo_overrides(), k_max=2, num_prompts=1,
                       max_new_tokens=16, rounds=3, cache_dir=tmp_path / "cache",
                       per_batch=[1, 2])
    pb = result.to_json()["per_batch"]
    assert [p["batch_size"] for p in pb] == [1, 2]
    for p in pb:
        _assert_per_batch_choice(p["chosen_k"], p["table"])
    # the recipe's batch is 1: its K, unless no K is predicted to beat the target alone
    from qpcbuild.runtime.gate import DEFAULT

    assert pb[0]["chosen_k"] == (result.chosen_k if max(
        r["predicted_speedup"] for r in pb[0]["table"][1:]) >= 1 + DEFAULT.margin else 0)
    line = f"# tune: best K per batch size: 1:{pb[0]['chosen_k']}, 2:{pb[1]['chosen_k']}"
    assert line in tune.evidence_comment(result)
    from qpcbuild.bundle.manifest_model import Tuning

    m = peer_manifest(tmp_path, tmp_path).model_copy(
        update={"tuning": Tuning.model_validate_json(json.dumps(result.to_json(), default=str))})
    assert any(x.startswith("# tune --per-batch: best K by batch size 1:") for x in host_setup(m))
    assert not any("per-batch" in x for x in host_setup(m.model_copy(update={"tuning": None})))


def test_tune_per_batch_times_a_cb_recipe_on_its_own_slots(tmp_path, monkeypatch):
    """With continuous batching a step's cost is that of the live rows among the bundle's
    slots, not that of a static batch: tune times the CB bundle itself with b slots live, and
    builds no batch-b bundle; sizes above the slots are refused."""
    import qpcbuild.measuring as measuring
    import qpcbuild.tune.costs as costs

    built, timed = [], []
    real_build, real_measure = measuring.build_for_measurement, costs.measure_costs
    monkeypatch.setattr(measuring, "build_for_measurement",
                        lambda *a, **kw: (built.append(a[3]), real_build(*a, **kw))[1])
    monkeypatch.setattr(costs, "measure_costs", lambda g, *a, live=None, **kw: (
        timed.append((g.target.batch_size, live)), real_measure(g, *a, live=live, **kw))[1])
    overrides = demo_overrides() + ["shapes.full_batch_size=4"]
    result = tune.tune(ROOT / "recipes" / "demo.yaml", overrides, k_max=2, num_prompts=1,
                       max_new_tokens=16, rounds=3, cache_dir=tmp_path / "cache",
                       per_batch=[1, 2, 4])
    assert [p.batch_size for p in result.per_batch] == [1, 2, 4]
    assert not any("costs-b" in str(path) for path in built)
    assert sorted(timed) == [(4, 1), (4, 2), (4, 4)]
    with pytest.raises(UsageError, match="exceeds the recipe's full_batch_size 4"):
        tune.tune(ROOT / "recipes" / "demo.yaml", overrides, k_max=2, num_prompts=1,
                  max_new_tokens=16, rounds=3, cache_dir=tmp_path / "cache", per_batch=[8])



@pytest.mark.parametrize("peer", ["llama.cpp", "vllm"])
def test_bench_names_where_the_peers_that_need_a_build_are_measured(peer, tmp_path):
    """llama.cpp and vLLM are not the package's peers: asking for one is bad input (exit 2),
    answered before any bundle is built, with the script that measures it."""
    from typer.testing import CliRunner
    from qpcbuild.cli import app

    result = CliRunner().invoke(app, ["bench", str(ROOT / "recipes" / "demo.yaml"),
                                      "--peers", f"transformers,{peer}",
                                      "--bundle-dir", str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    assert f"peer '{peer}'" in result.output and "benchmarks/peers/run.py" in result.output
    assert not (tmp_path / "b").exists()

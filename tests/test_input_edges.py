"""Inputs found by a probe of hostile and unlucky values: undecodable prompts, JSONL lines that are
not objects, giant numbers, output paths that are folders, NaN card figures, a recipe with
problems of several kinds, a manifest without its id. Each is exit 1 or 2 with a message before
any work, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.cli import app

ROOT = Path(__file__).resolve().parents[1]
DEMO_RECIPE = ROOT / "recipes" / "demo.yaml"
pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def bundle(demo_build) -> Path:
    return demo_build[0]


def clean_exit(result, code: int, says: str) -> None:
    assert result.exit_code == code and says in result.output, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)


def test_a_prompt_argument_that_is_not_utf8(bundle):
    # Python hands undecodable argv bytes over as lone surrogates (b"\xff" -> "\udcff").
    clean_exit(runner.invoke(app, ["run", str(bundle), "--prompt", "ab\udcff"]), 2, "UTF-8")


@pytest.mark.parametrize("lines, says", [
    (['{"prompt": "\\ud800"}'], "UTF-8"),
    (['{"prompt": "fine"}', "[1, 2]"], "not a JSON list"),
    (['{"prompt": "fine"}', '"just a string"'], "not a JSON str"),
    (['{"prompt": "x", "n": ' + "9" * 5001 + "}"], "not valid JSON"),
])
def test_prompt_file_lines(bundle, tmp_path, lines, says):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    clean_exit(runner.invoke(app, ["run", str(bundle), "--prompt-file", str(path)]), 2, says)


def test_a_text_prompt_file_may_still_start_a_line_with_a_bracket(bundle, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("[INST] say hi\n")
    result = runner.invoke(app, ["run", str(bundle), "--prompt-file", str(path),
                                 "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output


def test_output_files_that_are_folders_fail_before_the_work(bundle, tmp_path):
    clean_exit(runner.invoke(app, ["bench", str(bundle), "--json-out", str(tmp_path),
                                   "--peers", "none"]), 2, "is a folder")
    clean_exit(runner.invoke(app, ["tune", str(DEMO_RECIPE), "--write", str(tmp_path)]), 2,
               "is a folder")
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("option", ["--card-tflops", "--card-bandwidth-gbs"])
@pytest.mark.parametrize("value", ["nan", "inf", "-3", "0"])
def test_card_figures_must_be_positive_numbers(tmp_path, option, value):
    result = runner.invoke(app, ["tune", str(DEMO_RECIPE), "--cost-model", option, value,
                                 "--cache-dir", str(tmp_path / "cache")])
    clean_exit(result, 2, option)


def test_a_recipe_with_problems_of_three_kinds_reports_all_three(tmp_path):
    recipe = tmp_path / "three.yaml"
    recipe.write_text(DEMO_RECIPE.read_text()
                      .replace("../models/demo/target", str(tmp_path / "no-such-model"))
                      .replace("../models/demo/draft", str(ROOT / "models" / "demo" / "draft"))
                      .replace("batch_size: 1", "batch_size: -1")          # schema
                      .replace("prefill_seq_len: 32", "prefill_seq_len: 1024"))  # cross-field
    result = runner.invoke(app, ["compile", str(recipe), "-o", str(tmp_path / "out")])
    clean_exit(result, 2, "3 problem(s)")
    for key in ("shapes.batch_size", "shapes.prefill_seq_len", "target.model"):
        assert key in result.output, result.output


def test_verify_of_a_manifest_without_bundle_id(bundle, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    m = json.loads((copy / "manifest.json").read_text())
    del m["bundle_id"]
    (copy / "manifest.json").write_text(json.dumps(m))
    clean_exit(runner.invoke(app, ["verify", str(copy)]), 1, "bundle_id")
    clean_exit(runner.invoke(app, ["run", str(copy), "--prompt", "x"]), 1, "bundle_id")

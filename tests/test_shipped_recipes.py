"""Every recipe under recipes/ builds, verifies and runs here: the ones for ONNX Runtime as
they are, the card recipes in their --emit-only --smoke-weights form (random weights of the
exact shapes, one layer, the qaic backend's compiler inputs and compile.sh)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qpcbuild.bundle import read_manifest, verify_bundle
from qpcbuild.cli import app
from qpcbuild.recipe import NGRAM_DEFAULTS, SUFFIX_DEFAULTS
from qpcbuild.runtime.proposers import OPTION_NAMES

from conftest import gemma3_missing, qwen_coder_missing, real_model_missing

pytestmark = pytest.mark.slow
RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
runner = CliRunner()


def runs_here(recipe: Path) -> bool:
    return yaml.safe_load(recipe.read_text()).get("backends", ["onnxruntime"]) == ["onnxruntime"]


def shares_the_qwen_coder_export(recipe: Path) -> bool:
    """recipes/qwen-coder.yaml and its ngram / suffix variants: one float32 1.5B target export,
    which tests/test_qwen_coder.py builds once and runs with each method against transformers.
    The int4 variant is a bundle of its own (about 3 minutes), built here."""
    r = yaml.safe_load(recipe.read_text())
    return "qwen2.5-coder" in r["target"]["model"] and \
        (r.get("onnxruntime") or {}).get("target_weights", "float32") == "float32"


def skip_unless_fetched(recipe: Path) -> None:
    model = yaml.safe_load(recipe.read_text())["target"]["model"]
    why = real_model_missing() if "smollm2" in model else \
        qwen_coder_missing() if "qwen2.5-coder" in model else \
        gemma3_missing() if "gemma-3" in model else None
    if why:
        pytest.skip(why)


def test_recipe_and_runtime_agree_on_proposer_option_names():
    assert set(NGRAM_DEFAULTS) == set(OPTION_NAMES["ngram"])
    assert set(SUFFIX_DEFAULTS) == set(OPTION_NAMES["suffix"])


@pytest.mark.parametrize("recipe", [r for r in RECIPES if runs_here(r) and
                                    not shares_the_qwen_coder_export(r)], ids=lambda p: p.stem)
def test_onnxruntime_recipe_builds_verifies_and_runs(recipe, tmp_path):
    skip_unless_fetched(recipe)
    out = tmp_path / "bundle"
    # --no-cache: the build's artifacts move into the bundle instead of being copied out of a
    # cache (a Qwen2.5-Coder build would otherwise hold its graphs twice on disk)
    built = runner.invoke(app, ["compile", str(recipe), "-o", str(out), "--no-cache"])
    assert built.exit_code == 0, built.output
    assert verify_bundle(out) == []
    ran = runner.invoke(app, ["run", str(out), "--prompt", "def fibonacci(n):",
                              "--max-new-tokens", "24", "--compare-baseline", "--json"])
    assert ran.exit_code == 0, ran.output
    report = json.loads(ran.stdout)
    method = read_manifest(out).to_json_dict()["speculation"]["method"]
    assert report["method"] == method
    assert len(report["batches"][0]["outputs"][0]["token_ids"]) > 0
    assert report["baseline"]["outputs_match"] is True  # greedy SpD == target-only


# One layer of a large model is still GBs: the 14B target's 152k x 5120 embedding and head make
# a 7.4 GB float32 graph, 13 GB of disk with its smoke weights and the draft's, more than a CI
# runner has beside the converted models. A float16 export halves that; what is checked here
# (specializations, custom I/O, compile.sh) does not depend on the export's dtype, and the
# float32 export's compiler inputs are checked on the demo pair (tests/test_qaic_backend.py).
SMOKE_EXPORT = ["--set", "precision.export_dtype=float16"]


@pytest.mark.parametrize("recipe", [r for r in RECIPES if not runs_here(r)], ids=lambda p: p.stem)
def test_card_recipe_emits_compiler_inputs_with_smoke_weights(recipe, tmp_path):
    skip_unless_fetched(recipe)  # a local model folder: its config.json gives the shapes
    # --no-cache: these graphs are GBs even with one layer; a cache would hold a second copy.
    out = tmp_path / "bundle"
    built = runner.invoke(app, ["compile", str(recipe), "-o", str(out), "--no-cache",
                                "--emit-only", "--smoke-weights", "--smoke-layers", "1",
                                "--set", "backends=[qaic]", *SMOKE_EXPORT])
    try:
        assert built.exit_code == 0, built.output
        assert verify_bundle(out) == []
        m = read_manifest(out).to_json_dict()
        for role, info in m["roles"].items():
            q = info["backends"]["qaic"]
            assert q["status"] == "emitted" and info["source"]["smoke_weights"] is True
            assert os.access(out / q["compile_script"], os.X_OK)
            specs = json.loads((out / role / "qaic" / "specializations.json").read_text())
            assert len(specs["specializations"]) == len(info["specializations"])
    finally:
        shutil.rmtree(out, ignore_errors=True)

"""What a new user meets first, through the installed entry point (`python -m qpcbuild` in a
subprocess, as a shell runs it): the reference recipe without its weights, the SDK hand-off,
output written to a log file rather than a terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "recipes" / "llama8b-1b.yaml"


def qpcbuild(*argv, cwd: Path, env: dict | None = None, timeout: int = 600):
    """Run the command as a user would, output going to pipes (not a terminal)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "QPCBUILD_CACHE": str(cwd / "cache"),
                **(env or {})}
    return subprocess.run([sys.executable, "-m", "qpcbuild", *map(str, argv)], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- 1: weights not on the machine
@pytest.mark.parametrize("argv", [
    ["compile", REFERENCE], ["compile", REFERENCE, "--emit-only"], ["bench", REFERENCE],
    ["tune", REFERENCE]], ids=["compile", "emit-only", "bench", "tune"])
def test_reference_recipe_without_weights_says_where_it_looked_and_what_to_do(tmp_path, argv):
    hf = tmp_path / "hf"
    done = qpcbuild(*argv, cwd=tmp_path, env={"HF_HUB_CACHE": str(hf), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr
    err = " ".join(done.stderr.split())  # rich may wrap; the words are what matter
    assert "Traceback" not in err and "TypeError" not in err
    assert "meta-llama/Llama-3.1-8B-Instruct" in err
    assert f"no folder {REPO / 'recipes' / 'meta-llama' / 'Llama-3.1-8B-Instruct'}" in err
    assert f"Hugging Face cache at {hf} (revision main)" in err
    assert "huggingface-cli download meta-llama/Llama-3.1-8B-Instruct --revision main" in err
    assert f"qpcbuild compile {REFERENCE} --smoke-weights" in err
    assert not (tmp_path / "build").exists()  # nothing half-written


def test_reference_recipe_without_weights_json_error_on_stdout(tmp_path):
    done = qpcbuild("compile", REFERENCE, "--emit-only", "--json", cwd=tmp_path,
                    env={"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert error["code"] == 2 and error["type"] == "UsageError"
    assert "--smoke-weights" in error["message"] and "Llama-3.1-8B-Instruct" in error["message"]

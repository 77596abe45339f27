"""What a new user meets on a fresh clone (issue 48, items 1-14): commands that make the folders
they need, errors that name the problem, advice that names what is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.cli import app
from qpcbuild.errors import UsageError
from qpcbuild.prompts import read_prompt_file

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


# ---------------------------------------------------------------- 11: keygen into a new folder
def test_keygen_makes_the_missing_keys_folder(tmp_path):
    key = tmp_path / "keys" / "release"
    result = runner.invoke(app, ["keygen", str(key)])
    assert result.exit_code == 0, result.output
    assert key.is_file() and Path(f"{key}.pub").is_file()
    assert oct(key.stat().st_mode & 0o777) == "0o600"


def test_keygen_under_a_file_exits_2_naming_it_and_writes_nothing(tmp_path):
    (tmp_path / "keys").write_text("not a folder")
    result = runner.invoke(app, ["keygen", str(tmp_path / "keys" / "release")])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert str(tmp_path / "keys") in " ".join(result.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys"]


# ---------------------------------------------------------------- 14: a JSON list is not a prompt
@pytest.mark.parametrize("text", ["[1,2]\n", "hello\n [1, 2] \n", '{"prompt": "a"}\n[1,2]\n'])
def test_a_prompt_line_that_is_a_json_list_is_refused_naming_the_line(tmp_path, text):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(UsageError, match=r"prompts.jsonl:\d: .*JSON list"):
        read_prompt_file(path)


def test_a_bracketed_text_prompt_that_is_not_json_stays_text(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("[INST] write a haiku [/INST]\n[1, 2\n")
    assert read_prompt_file(path) == ["[INST] write a haiku [/INST]", "[1, 2"]


# ---------------------------------------------------------------- 4: advice that can be followed
def test_missing_hub_model_advice_names_the_download_command_the_installed_hub_ships(tmp_path):
    from importlib import metadata

    scripts = {ep.name for ep in metadata.distribution("huggingface_hub").entry_points
               if ep.group == "console_scripts"}
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes" / "llama8b-1b.yaml").read_text())
    result = runner.invoke(app, ["compile", str(recipe), "-o", str(tmp_path / "b")],
                           env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    named = "hf" if "hf" in scripts else "huggingface-cli"
    assert f"`{named} download meta-llama/Llama-3.1-8B-Instruct" in text
    assert named in scripts  # a command the user actually has


@pytest.mark.parametrize("folder, target", [("qwen2.5-coder-1.5b-instruct", "make qwen-coder"),
                                            ("smollm2-135m-instruct", "make smollm2")])
def test_a_missing_project_model_folder_names_the_make_target_that_makes_it(tmp_path, folder,
                                                                            target):
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    text = (REPO / "recipes" / "qwen-coder-ngram.yaml").read_text()
    recipe.write_text(text.replace("qwen2.5-coder-1.5b-instruct", folder))
    result = runner.invoke(app, ["plan", str(recipe)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"`{target}`" in said and "`make models`" in said, said


# ---------------------------------------------------------------- 1: the heavy tier, said and skippable
def test_make_test_states_the_heavy_tiers_cost_and_how_to_skip_it_and_ci_requires_it():
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("make test   #"):readme.index("```", readme.index("make test   #"))]
    assert "9.6 GB" in block and "15 GB of memory" in block and "QPCBUILD_HEAVY=skip" in block
    makefile = (REPO / "Makefile").read_text()
    assert "skip) echo" in makefile and "QPCBUILD_HEAVY=required" in makefile
    assert "export QPCBUILD_HEAVY=required" in (REPO / ".ci" / "run").read_text()


def test_heavy_skip_dry_run_fetches_nothing(tmp_path):
    import subprocess

    done = subprocess.run(["make", "-n", "test", "QPCBUILD_HEAVY=skip",
                           f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert "QPCBUILD_HEAVY=skip: Qwen2.5-Coder not fetched" in done.stdout, done.stdout
    assert "get_models.py qwen-coder" not in done.stdout


# ---------------------------------------------------------------- 12: offline make demo
def offline_checkout(tmp: Path, converted: bool) -> tuple[Path, Path, dict]:
    """The Makefile and scripts in a copy, a venv whose pip always fails (as offline) and
    logs each call, SmolLM2's folder converted (digests recorded) or absent."""
    import hashlib
    import os
    import shutil
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    import get_smollm2

    root = tmp / "clone"
    for rel in ("Makefile", "pyproject.toml", "setup.py", "scripts",
                "qpcbuild/runtime/_suffix_tree.c"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (REPO / rel).is_dir() else shutil.copy
        copy(REPO / rel, root / rel)
    venv, log = tmp / "venv", tmp / "pip.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nif [ \"$1\" = -m ] && [ \"$2\" = pip ]; then\n"
                      f"  echo \"$*\" >> {log}; echo 'ERROR: No matching distribution found "
                      f"for setuptools>=77' >&2; exit 1\nfi\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    (venv / ".installed").touch()
    if converted:
        folder = root / "models" / "smollm2-135m-instruct"
        folder.mkdir(parents=True)
        files = {}
        for name in get_smollm2.REQUIRED:
            data = f"{name} of a converted model\n".encode()
            (folder / name).write_bytes(data)
            files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (folder / "conversion.json").write_text(json.dumps(
            {"source": {"version": get_smollm2.VERSION}, "files": files}))
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    return root, log, {"cwd": root, "env": env, "capture_output": True, "text": True,
                       "timeout": 120, "args": ["make", "smollm2", f"VENV={venv}"]}


def test_make_smollm2_with_the_model_on_disk_installs_nothing(tmp_path):
    import subprocess

    root, log, run = offline_checkout(tmp_path, converted=True)
    done = subprocess.run(**run)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is complete (sha256 checked)" in done.stdout
    assert not log.exists(), log.read_text()  # pip never ran


def test_make_smollm2_offline_without_the_model_says_which_step_failed(tmp_path):
    import subprocess

    root, log, run = offline_checkout(tmp_path, converted=False)
    done = subprocess.run(**run)
    assert done.returncode != 0
    assert "installing the packages the conversion needs (torch, the smollm2 extra) failed" \
        in done.stdout, done.stdout
    assert "setuptools>=77" in done.stderr  # pip's own reason, shown


# ---------------------------------------------------------------- 3: long steps speak in a log
def test_a_long_step_in_a_log_prints_progress_lines_while_it_runs(monkeypatch):
    import io
    import time

    from rich.console import Console

    from qpcbuild import progress

    monkeypatch.setenv("QPCBUILD_PROGRESS_INTERVAL", "0.05")
    monkeypatch.setattr(progress, "_reporter", None)  # put back after the test
    log = io.StringIO()
    progress.report_to(Console(file=log, force_terminal=False, width=200))
    with progress.step("pulling x", total=4_000_000, unit="bytes") as advance:
        advance(1_000_000)
        time.sleep(0.4)
        advance(3_000_000)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    running = [line for line in lines if line.endswith("s so far")]
    assert running and running[0].startswith("pulling x: 1.0 MB of 4.0 MB (25%), "), lines
    assert " MB/s, " in running[0] or " kB/s, " in running[0], running[0]
    assert lines[-1].startswith("pulling x: 4.0 MB in 0.") and lines[-1].endswith(" MB/s)"), \
        lines[-1]


@pytest.mark.slow
def test_compile_in_a_log_says_a_backend_step_is_still_running(tmp_path):
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "qpcbuild", "compile", str(REPO / "recipes" / "demo.yaml"), "-o",
         str(tmp_path / "b"), "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "QPCBUILD_PROGRESS_INTERVAL": "0.01"})
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "onnxruntime target: running, " in out and " s so far" in out, out
    assert "exporting target" in out and "tensors of 56 tensors" in out, out


# ---------------------------------------------------------------- 6: one rule for a tuned K
def test_a_tuned_k_keeps_the_recipes_lower_ks_by_one_rule():
    from qpcbuild.tune.recipe_edit import tuned_k_value

    from qpcbuild.tune import ConfidenceStop

    assert tuned_k_value([0, 4], 3) == [0, 3]
    assert tuned_k_value([0, 2, 8], 5) == [0, 2, 5]
    assert tuned_k_value(4, 3) == 3
    stop = ConfidenceStop(draft_p_min=0.3, ks=(2, 6), predicted_tokens_per_s=100.0,
                          predicted_speedup=1.2, beats_best_fixed_k=True, k_max=6, table=())
    assert tuned_k_value([0, 4], 6, stop) == [0, 2, 6]


def test_a_k_its_own_model_check_contradicts_is_refused_unless_forced_naming_busy_runner_ways():
    from qpcbuild.errors import QpcbuildError
    from qpcbuild.tune.report import refuse_if_contradicted

    from qpcbuild.tune import ModelCheck
    from qpcbuild.tune.report import disagreements
    from helpers_tune import made_decision

    # the run's own check measured 34 tokens/s where the model predicted 120: 3.5x off
    result = disagreements(made_decision(3, model_check=(
        ModelCheck("draft_model K=3", predicted=120.0, measured=34.0),
        ModelCheck("target-only", predicted=60.0, measured=50.0))))
    assert result.evidence.model_check[0].error == pytest.approx(120 / 34 - 1, abs=1e-4)
    assert result.model_check_disagrees == (
        "draft_model K=3 predicted 120 tokens/s, measured 34 (3.5x; the tolerance is 2x "
        "either way)",)
    with pytest.raises(QpcbuildError) as info:
        refuse_if_contradicted(result, False, "--tune-force", "nothing was built")
    text = str(info.value)
    assert info.value.exit_code == 1 and "(3.5x" in text
    assert "--cost-model" in text and "--rounds 60" in text and "--tune-force" in text
    assert "so nothing was built" in text
    refuse_if_contradicted(result, True, "--tune-force", "-")  # forced: goes ahead
    refuse_if_contradicted(disagreements(made_decision(3)), False, "--force", "-")


def test_compile_tune_options_need_tune():
    result = runner.invoke(app, ["compile", str(REPO / "recipes" / "demo.yaml"),
                                 "--tune-cost-model"])
    assert result.exit_code == 2 and "go with --tune" in result.output, result.output


# ---------------------------------------------------------------- 10: the smaller list
def test_readme_command_table_names_every_command():
    import typer

    table = (REPO / "README.md").read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    for name in typer.main.get_command(app).list_commands(None):
        assert f"`qpcbuild {name}" in table or f"/ `{name}`" in table or f"`{name}`" in table, \
            name


def test_make_demo_states_its_disk_footprint_and_ends_with_what_next(tmp_path):
    import subprocess

    readme = (REPO / "README.md").read_text()
    assert "the bundle `build/smollm2` 666 MB" in readme and "build cache 1.4 GB" in readme
    done = subprocess.run(["make", "-n", "demo-run", "RECIPE=demo", f"VENV={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "What next" in done.stdout and "qpcbuild serve build/demo" in done.stdout


def test_a_plot_asked_for_without_matplotlib_names_the_extra(tmp_path):
    from qpcbuild.bench.report import write_outputs

    def no_matplotlib(report, path):
        raise ImportError("No module named 'matplotlib'")

    report = {"notes": []}
    json_path, png = write_outputs(report, tmp_path / "r.json", None, no_matplotlib)
    assert png is None and json_path.is_file()
    assert "pip install -e '.[bench]'" in report["notes"][0]


@pytest.mark.slow
def test_sampled_runs_say_not_applicable_and_a_capped_budget_is_said(demo_build):
    result = runner.invoke(app, ["run", str(demo_build[0]), "--prompt", "w1 w2 w3",
                                 "--max-new-tokens", "600", "--temperature", "0.8", "--seed",
                                 "1", "--compare-baseline", "--verify", "none"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "greedy outputs match: not applicable (sampling)" in said
    assert "--max-new-tokens 600 capped to" in said and "ctx_len 512" in said


@pytest.mark.slow
def test_progress_on_an_80_column_terminal_keeps_the_counts_whole(demo_build, tmp_path):
    import fcntl
    import os
    import pty
    import re
    import shutil
    import struct
    import sys
    import termios

    bundle = tmp_path / ("a-folder-whose-name-is-long-enough-to-overflow-" * 2) / "the-bundle"
    shutil.copytree(demo_build[0], bundle)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO)
    pid, fd = pty.fork()
    if pid == 0:  # the child: verify with an 80-column terminal for its output
        os.execve(sys.executable, [sys.executable, "-m", "qpcbuild", "verify", str(bundle)], env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    out = b""
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        out += data
    os.waitpid(pid, 0)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))
    bars = [line for line in re.split(r"[\r\n]+", text) if line.startswith("hashing ")]
    assert bars, text
    assert all(len(line) <= 80 for line in bars), bars
    assert any(re.search(r"hashing …[\w/-]*/the-bundle .*\d+\.\d MB of \d+\.\d MB", line)
               for line in bars), bars

"""What a new user meets first, through the installed entry point (`python -m qpcbuild` in a
subprocess, as a shell runs it): the reference recipe without its weights, the SDK hand-off,
output written to a log file rather than a terminal."""

from __future__ import annotations

import json
import os
import re
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
    assert "hf download meta-llama/Llama-3.1-8B-Instruct --revision main" in err
    assert f"qpcbuild compile {REFERENCE} --smoke-weights" in err
    assert not (tmp_path / "build").exists()  # nothing half-written


def test_reference_recipe_without_weights_json_error_on_stdout(tmp_path):
    done = qpcbuild("compile", REFERENCE, "--emit-only", "--json", cwd=tmp_path,
                    env={"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert error["code"] == 2 and error["type"] == "UsageError"
    assert "--smoke-weights" in error["message"] and "Llama-3.1-8B-Instruct" in error["message"]


# ---------------------------------------------------------------- 2: the README's SDK hand-off
STAND_IN_COMPILER = """#!/usr/bin/env bash
# Test fixture only: writes a placeholder where qaic-compile would write the program.
set -e
for a in "$@"; do case "$a" in -aic-binary-dir=*) out="${a#-aic-binary-dir=}";; esac; done
mkdir -p "$out" && printf 'placeholder program for %s' "$out" > "$out/programqpc.bin"
echo "stand-in compiled $out"
"""


def documented_block(first_line: str) -> str:
    """The ```bash block of the docs whose first line is `first_line`."""
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in page.read_text().split("```bash\n")[1:]:
            body = block.split("```")[0]
            if body.startswith(first_line + "\n"):
                return body
    raise AssertionError(f"no documented block starts with {first_line!r}")


def fake_hf_cache(root: Path, models: dict[str, Path]) -> Path:
    """What `hf download REF` leaves behind (refs/main -> one snapshot)."""
    for ref, folder in models.items():
        repo = root / f"models--{ref.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0123abcd")
        snapshot = repo / "snapshots" / "0123abcd"
        snapshot.mkdir(parents=True)
        for f in folder.iterdir():
            (snapshot / f.name).write_bytes(f.read_bytes())
    return root


@pytest.mark.slow
def test_readme_sdk_hand_off_runs_as_written(tmp_path):
    """The two documented blocks, line by line through bash, on two 'machines' (folders): the
    reference recipe with the demo pair standing in for Llama in the HF cache, a stand-in
    compiler on the SDK side and the `qpcbuild` command on PATH on both."""
    here, sdk, tools = tmp_path / "here", tmp_path / "sdk", tmp_path / "bin"
    for folder in (here, sdk, tools):
        folder.mkdir()
    (here / "recipes").mkdir()
    (here / "recipes" / REFERENCE.name).write_text(REFERENCE.read_text())
    hf = fake_hf_cache(tmp_path / "hf", {
        "meta-llama/Llama-3.1-8B-Instruct": REPO / "models" / "demo" / "target",
        "meta-llama/Llama-3.2-1B-Instruct": REPO / "models" / "demo" / "draft"})
    (tools / "qpcbuild").write_text(f'#!/bin/sh\nexec {sys.executable} -m qpcbuild "$@"\n')
    (tools / "qaic-compile").write_text(STAND_IN_COMPILER)
    for tool in tools.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(hf),
           "HF_HUB_OFFLINE": "1", "QPCBUILD_CACHE": str(tmp_path / "cache"),
           "QAIC_COMPILER": str(tools / "qaic-compile"),
           "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}

    def run_block(block: str, cwd: Path) -> str:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    run_block(documented_block("# here (no SDK)"), here)
    # Carry the archive over; the SDK machine's folder already holds other things.
    (sdk / "llama8b-1b.tar").write_bytes((here / "llama8b-1b.tar").read_bytes())
    (sdk / "notes.txt").write_text("unrelated")
    shown = run_block(documented_block("# on the SDK machine, in the folder that holds "
                                       "llama8b-1b.tar"), sdk)
    assert "stand-in compiled target/qpc" in shown and "stand-in compiled draft/qpc" in shown
    assert "matches its content and every file" in shown
    bundle = sdk / "llama3.1-8b-instruct-spd-llama3.2-1b"
    # `finish` (called by each compile.sh) hashes the whole bundle before it adopts a QPC (a
    # byte flipped after `compile --emit-only` is refused, naming the file), and `verify` hashes
    # it again: each says so in one line (the output is a pipe). The QPCs and logs add bytes only.
    hashed = [line.split(" in ")[0] for line in shown.splitlines() if line.startswith("hashing")]
    written = {f"{r}/{part}": sum(f.stat().st_size for f in (bundle / r / part).rglob("*"))
               for r in ("target", "draft") for part in ("qpc", "logs")}
    assert all(0 < size < 1000 for size in written.values())
    everything = sum(f.stat().st_size for f in bundle.rglob("*")  # files: a folder has a size too
                     if f.is_file() and f.name != "manifest.json")
    assert hashed == [f"hashing .: {everything / 1e6:.1f} MB"] * 3, shown
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert {r: manifest["roles"][r]["backends"]["qaic"]["status"]
            for r in ("target", "draft")} == {"target": "compiled", "draft": "compiled"}
    # A second unpack refuses the existing bundle folder and leaves it as it was.
    again = qpcbuild("unpack", "llama8b-1b.tar", "-d", ".", cwd=sdk)
    assert again.returncode == 2 and "exists" in again.stderr, again.stderr
    assert (bundle / "target" / "qpc" / "programqpc.bin").is_file()


@pytest.mark.slow
def test_same_bundle_from_differently_named_folders_packs_to_the_same_bytes(tmp_path):
    demo = REPO / "recipes" / "demo.yaml"
    archives = []
    for folder in ("pa", "pb"):
        built = qpcbuild("compile", demo, "-o", tmp_path / folder, cwd=tmp_path)
        assert built.returncode == 0, built.stderr
        packed = qpcbuild("package", tmp_path / folder, "-o", tmp_path / f"{folder}.tar",
                          cwd=tmp_path)
        assert packed.returncode == 0, packed.stderr
        archives.append((tmp_path / f"{folder}.tar").read_bytes())
    assert archives[0] == archives[1]
    unpacked = qpcbuild("unpack", tmp_path / "pa.tar", "-d", tmp_path / "u", cwd=tmp_path)
    assert unpacked.returncode == 0 and (tmp_path / "u" / "demo" / "manifest.json").is_file()


# ---------------------------------------------------------------- 3: progress
def plain_step_lines(text: str) -> list[str]:
    assert "\r" not in text and "\x1b[" not in text  # nothing that redraws or colours
    return text.splitlines()


@pytest.mark.slow
def test_long_steps_say_one_plain_line_each_in_a_log(tmp_path):
    """export, hash, package, cache prune and run, as a CI log sees them."""
    steps = [(["compile", REPO / "recipes" / "demo.yaml", "-o", "b"],
              [r"exporting target \S+/models/demo/target: 56 tensors in \d+\.\d s",
               r"exporting draft \S+/models/demo/draft: 20 tensors in",
               # (the seal reads only what the cache did not deliver with recorded digests)
               r"hashing b: \d+\.\d kB in"]),
             (["verify", "b"], [r"hashing b: \d+\.\d MB in \d+\.\d s"]),
             (["package", "b", "-o", "b.tar"], [r"packing b.tar: \d+\.\d MB in"]),
             (["cache", "prune"], [rf"checking {tmp_path}/cache: 4 entries in"]),
             (["run", "b", "--prompt", "w1 w2", "--prompt", "w3", "--max-new-tokens", "4",
               "--verify", "none"], [r"decoding b: [1-8] tokens in \d+\.\d s"])]
    for argv, expected in steps:
        done = qpcbuild(*argv, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        lines = plain_step_lines(done.stderr)
        for pattern in expected:
            assert sum(bool(re.fullmatch(pattern + ".*", line)) for line in lines) == 1, \
                (pattern, done.stderr)


@pytest.mark.slow
def test_progress_draws_bars_on_a_terminal(tmp_path):
    built = qpcbuild("compile", REPO / "recipes" / "demo.yaml", "-o", "b", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    import pty

    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command with a terminal for its output
        os.chdir(tmp_path)
        os.execve(sys.executable, [sys.executable, "-m", "qpcbuild", "verify", "b"], env)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "━" in text and "100%" in text and re.search(r"\d+\.\d MB of \d+\.\d MB", text)


# ---------------------------------------------------------------- 4: output in a log
@pytest.fixture(scope="module")
def demo_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo-bundle")
    done = qpcbuild("compile", REPO / "recipes" / "demo.yaml", "-o", root / "b", cwd=root)
    assert done.returncode == 0, done.stderr
    return root / "b"


def table_row(text: str, key: str) -> list[str]:
    line = next(line for line in text.splitlines() if re.match(rf"[│┃] {key} ", line))
    return [cell.strip() for cell in re.split("[│┃]", line.strip("│┃"))]


@pytest.mark.slow
def test_run_in_a_log_keeps_generated_text_whole_titles_prompts_and_totals_metrics(
        demo_bundle, tmp_path):
    prompts = ["w1 w2 w3 w4", "w9\tw8 w7"]
    argv = ["run", demo_bundle, *(a for p in prompts for a in ("--prompt", p)),
            "--max-new-tokens", "120", "--verify", "none"]
    as_json = qpcbuild(*argv, "--json", cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    texts = [o["text"] for b in report["batches"] for o in b["outputs"]]
    assert max(len(t) for t in texts) > 80  # long enough that an 80-column wrap would show
    shown = qpcbuild(*argv, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    # Each prompt's text follows its title exactly as generated (greedy: the same as --json).
    for n, (prompt, text) in enumerate(zip(prompts, texts)):
        title = re.search(rf"^--- prompt {n}: {re.escape(' '.join(prompt.split()))} "
                          rf"\(length, \d+ tokens\) ---\n", out, re.M)
        assert title, out
        assert out[title.end():].startswith(text + "\n"), (text, out[title.end():][:300])
    # The metrics table: one column for all prompts, one listing each batch.
    stats = [b["stats"] for b in report["batches"]]
    assert table_row(out, "metric") == ["metric", "all prompts", "per batch"]
    for key in ("requests", "new_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_num_draft_tokens"):
        assert table_row(out, key) == [key, str(sum(s[key] for s in stats)),
                                       ", ".join(str(s[key]) for s in stats)]
    accepted = sum(s["spec_decode_num_accepted_tokens"] for s in stats)
    proposed = sum(s["spec_decode_num_draft_tokens"] for s in stats)
    assert table_row(out, "acceptance_rate")[1] == str(round(accepted / proposed, 4))


@pytest.mark.slow
def test_verify_and_inspect_in_a_log_print_whole_lines(demo_bundle, tmp_path):
    env = {"COLUMNS": ""}  # as a CI runner leaves it
    verified = qpcbuild("verify", demo_bundle, cwd=tmp_path, env=env)
    bundle_id = json.loads((demo_bundle / "manifest.json").read_text())["bundle_id"]
    assert f"✓ {demo_bundle}: bundle id {bundle_id} matches its content and every file\n" \
        in verified.stdout
    shown = qpcbuild("inspect", demo_bundle, cwd=tmp_path, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "…" not in shown.stdout
    assert table_row(shown.stdout, "target")[1:] == [
        "../models/demo/target", "LlamaForCausalLM", "5,205,248",
        "Prefill(32), Decode_0(1), Decode_1(5)", "10 x [0]", "onnxruntime: compiled"]


# ---------------------------------------------------------------- 5: smoke weights
@pytest.mark.slow
def test_smoke_weights_leave_nothing_in_the_cache_and_cache_ls_shows_everything(tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir()
    done = qpcbuild("compile", REPO / "recipes" / "demo.yaml", "-o", "smoke", "--smoke-weights",
                    cwd=tmp_path, env={"TMPDIR": str(temp)})
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "smoke" / "manifest.json").read_text()
                      )["roles"]["target"]["source"]["smoke_weights"] is True
    assert not (tmp_path / "cache").exists() and not list(temp.glob("*smoke*"))
    refused = qpcbuild("compile", REPO / "recipes" / "demo.yaml", "-o", "s2", "--smoke-weights",
                       "--cache-dir", "c", cwd=tmp_path)
    assert refused.returncode == 2 and "--cache-dir" in refused.stderr
    # A real build fills the cache; what older versions left there is listed and pruned too.
    assert qpcbuild("compile", REPO / "recipes" / "demo.yaml", "-o", "real",
                    cwd=tmp_path).returncode == 0
    old_smoke = tmp_path / "cache" / "smoke" / "smoke-0123456789abcdef"
    old_smoke.mkdir(parents=True)
    (old_smoke / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    (tmp_path / "cache" / "notes.txt").write_text("mine")
    listed = qpcbuild("cache", "ls", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert table_row(listed.stdout, "smoke")[1:3] == ["smoke-0123456789abcdef", "2.9"]  # MiB
    others = [line.split("│")[2].strip() for line in listed.stdout.splitlines()
              if line.startswith("│ other ")]
    assert {"locks", "digests", "notes.txt"} <= set(others), listed.stdout
    everything = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    assert f"{everything / 2**20:.1f} MiB in all under {tmp_path / 'cache'}" in listed.stdout
    pruned = qpcbuild("cache", "prune", cwd=tmp_path)
    assert pruned.returncode == 0 and "smoke/smoke-0123456789abcdef (random smoke weights" \
        in pruned.stdout
    assert not old_smoke.exists() and (tmp_path / "cache" / "notes.txt").exists()


# ---------------------------------------------------------------- 6: no unearned all-clear
@pytest.mark.slow
def test_doctor_without_card_graphs_has_nothing_to_check(demo_bundle, tmp_path):
    done = qpcbuild("doctor", demo_bundle, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "nothing to check: this bundle holds no card graph" in done.stdout
    assert "QEfficient's vocabulary" not in done.stdout


@pytest.mark.slow
def test_smoke_bundle_is_flagged_by_inspect_and_refused_by_serve_config(tmp_path):
    built = qpcbuild("compile", REPO / "recipes" / "demo.yaml", "-o", "smoke",
                     "--smoke-weights", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    shown = qpcbuild("inspect", "smoke", cwd=tmp_path)
    assert shown.returncode == 0 and "RANDOM SMOKE WEIGHTS (target, draft)" in shown.stdout
    refused = qpcbuild("serve-config", "smoke", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "holds random smoke weights" in refused.stderr


def test_plan_refuses_a_draft_whose_vocabulary_size_cannot_be_shown_to_match(tmp_path):
    draft = tmp_path / "tiny-draft"
    draft.mkdir()
    config = json.loads((REPO / "models" / "demo" / "draft" / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("schema: 1\nname: mismatch\ntarget:\n  model: Qwen/Qwen2.5-7B-Instruct\n"
                      "draft:\n  method: draft_model\n  model: ./tiny-draft\n"
                      "shapes: {ctx_len: 256}\n")
    done = qpcbuild("plan", recipe, cwd=tmp_path, env={"HF_HUB_CACHE": str(tmp_path / "hf"),
                                                       "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "vocab_size differs in config.json (target 152064, draft 4096)" in \
        " ".join(done.stderr.split())
    # A padded target within one tokenizer family plans, with vLLM's rule said.
    shipped = qpcbuild("plan", REPO / "recipes" / "qwen2.5-14b-1.5b.yaml", "--json", cwd=tmp_path,
                       env={"HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert shipped.returncode == 0, shipped.stderr
    assert any("vocab_size: target 152064, draft 151936" in w and "use_heterogeneous_vocab" in w
               for w in json.loads(shipped.stdout)["warnings"])


# ---------------------------------------------------------------- 7: tune trusts checked numbers
CHECK_MEASURED_AS = """
import sys
from dataclasses import replace
import qpcbuild.tune as tuning
measured_tune = tuning.tune
def tune(*args, **kwargs):  # the check's measurements as a machine {factor}x slower would give
    result = measured_tune(*args, **kwargs)
    checks = tuple(replace(c, measured=c.predicted / {factor}) if c.predicted else c
                   for c in result.evidence.model_check)
    return replace(result, evidence=replace(result.evidence, model_check=checks))
tuning.tune = tune
from qpcbuild.cli import app
sys.argv[0] = "qpcbuild"
app()
"""


@pytest.mark.slow
def test_tune_does_not_write_k_its_own_check_contradicts(tmp_path):
    import yaml

    recipe = tmp_path / "demo.yaml"
    recipe.write_text((REPO / "recipes" / "demo.yaml").read_text().replace(
        "../models/demo", str(REPO / "models" / "demo")))
    quick = ["tune", recipe, "--num-prompts", "2", "--max-new-tokens", "16", "--rounds", "3",
             "--k-max", "3", "--write"]

    def tune(factor: float, *argv):
        env = {**os.environ, "PYTHONPATH": str(REPO), "QPCBUILD_CACHE": str(tmp_path / "cache")}
        return subprocess.run([sys.executable, "-c", CHECK_MEASURED_AS.format(factor=factor),
                               *map(str, argv)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    off = tune(33, *quick, "off.yaml")
    assert off.returncode == 1, off.stdout + off.stderr
    assert not (tmp_path / "off.yaml").exists()
    said = " ".join((off.stdout + off.stderr).split())
    assert "predicted" in said and "(33x; the tolerance is 2x either way)" in said
    assert "recipe was not written" in said and "--force" in said
    for factor, argv, name in ((33, ["--force"], "forced.yaml"), (1.25, [], "agreed.yaml")):
        done = tune(factor, *quick, name, *argv)
        assert done.returncode == 0, done.stdout + done.stderr
        written = yaml.safe_load((tmp_path / name).read_text())["speculation"][
            "num_speculative_tokens"]
        # The summary shows exactly the value the file holds.
        assert f"wrote {name}: speculation.num_speculative_tokens: {written}" in \
            " ".join(done.stdout.split())


# ---------------------------------------------------------------- 8: start-up
HEAVY = ("onnx", "onnxruntime", "numpy", "torch", "transformers", "ml_dtypes")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["compile", "--help"],
                                  ["inspect", "{bundle}"], ["verify", "{bundle}"]],
                         ids=["help", "version", "compile-help", "inspect", "verify"])
def test_light_commands_import_no_heavy_module(tmp_path, argv):
    bundle = tmp_path / "b"  # a folder that is not a bundle: the command fails after start-up
    bundle.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "qpcbuild",
                           *(a.format(bundle=bundle) for a in argv)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "qpcbuild.cli" in imported, done.stderr[-2000:]
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_version_flag_and_help_without_bool_types(tmp_path):
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    done = qpcbuild("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == f"qpcbuild {version}\n"
    for command in ("compile", "export", "run", "tune", "bench", "verify", "serve"):
        shown = qpcbuild(command, "--help", cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert "<bool>" not in shown.stdout and "--help" in shown.stdout, command
    assert "--emit-only " in qpcbuild("compile", "--help", cwd=tmp_path).stdout


@pytest.mark.slow
def test_smoke_layers_help_and_validation_agree(tmp_path):
    shown = " ".join(qpcbuild("compile", "--help", cwd=tmp_path).stdout.replace("│", " ").split())
    assert "layers per model (0 = all)" in shown and "[x>=0]" in shown
    demo = REPO / "recipes" / "demo.yaml"
    refused = qpcbuild("compile", demo, "-o", "b", "--smoke-weights", "--smoke-layers", "-1",
                       cwd=tmp_path)
    assert refused.returncode == 2 and "--smoke-layers" in refused.stderr
    done = qpcbuild("compile", demo, "-o", "b", "--smoke-weights", "--smoke-layers", "0",
                    "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    for role in ("target", "draft"):  # every layer of the real config
        config = json.loads((REPO / "models" / "demo" / role / "config.json").read_text())
        assert manifest["roles"][role]["arch"]["num_layers"] == config["num_hidden_layers"]


# ---------------------------------------------------------------- 9: HTTP errors
@pytest.mark.slow
def test_http_errors_name_no_server_paths(demo_bundle, tmp_path):
    import socket
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "qpcbuild", "serve", str(demo_bundle),
                               "--port", str(port), "--verify", "none"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        body = json.dumps({"model": "demo", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "w1 w2"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(request, timeout=30)
                raise AssertionError("a bundle without a chat template answered a chat request")
            except urllib.error.HTTPError as exc:
                status, text = exc.code, exc.read().decode()
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None and time.monotonic() < deadline, \
                    server.stdout.read().decode() if server.poll() is not None else "timeout"
                time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert status == 400
    message = json.loads(text)["error"]["message"]
    assert "has no chat template" in message
    assert str(demo_bundle) not in text and str(demo_bundle.resolve()) not in text
    assert "/tmp" not in text and str(Path.home()) not in text


# ---------------------------------------------------------------- 10: make demo
def test_make_demo_installs_only_what_the_demo_needs_and_quietly(tmp_path):
    """`make -n` lists every command `make demo` would run (sub-makes included) without
    running any of them."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    installs = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert installs and all(" -qq " in line for line in installs), installs
    installed = " ".join(installs).replace(str(tmp_path), "TMP")
    assert "'.[smollm2]'" in installed and "torch==2.13.0" in installed
    assert "'.[dev]'" not in installed and "pytest" not in installed

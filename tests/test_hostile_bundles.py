"""Bundles and keys that someone else prepared: re-sealed manifests that name one file two ways,
numbers too long for Python's int parser, keys and signature files that are devices or FIFOs,
signatures in an algorithm qpcbuild does not check; and sampling at a temperature so small that
logits / T overflows. Each must end in a clear error or a right answer, never a traceback or a
hang. Commands that could hang run in a subprocess with a timeout."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from qpcbuild.bundle.manifest import MANIFEST, content_id, read_manifest
from qpcbuild.cli import app
from qpcbuild.errors import BundleError
from qpcbuild.runtime.sampling import SamplingParams, probabilities, sample

from helpers_server import LiveServer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # builds the demo bundle (once, shared)
runner = CliRunner()


def cli(*argv):
    return runner.invoke(app, [str(a) for a in argv])


def cli_process(*argv, timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI in its own process: a hang fails the test after `timeout` seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "qpcbuild", *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pristine(demo_build) -> Path:
    return demo_build[0]


def copy_of(pristine: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp / "bundle"))


def resealed(bundle: Path, edit) -> Path:
    """The manifest edited and its id recomputed, as a hand-written tool would (not through
    qpcbuild's own seal(), which refuses such manifests)."""
    m = json.loads((bundle / MANIFEST).read_text())
    edit(m, bundle)
    m["bundle_id"] = content_id(m)
    (bundle / MANIFEST).write_text(json.dumps(m))
    return bundle


# ---------------------------------------------------------------- one name per file
def double_slash(m, bundle):
    path = next(p for p in m["files"] if "/" in p)
    alias = path.replace("/", "//", 1)
    m["files"][alias] = m["files"][path]


def dot_prefix(m, bundle):
    m["files"]["./recipe.yaml"] = m["files"]["recipe.yaml"]


def file_and_folder(m, bundle):
    folder = next(p for p in m["files"] if "/" in p).split("/")[0]
    m["files"][folder] = m["files"]["recipe.yaml"]


def signatures_sealed(m, bundle):
    (bundle / "signatures.json").write_text('{"signatures": []}')
    m["files"]["signatures.json"] = {"size": 18, "sha256": hashlib.sha256(
        b'{"signatures": []}').hexdigest()}


@pytest.mark.parametrize("edit,says", [
    (double_slash, "is not written in canonical form"),
    (dot_prefix, "'./recipe.yaml' is not written in canonical form ('recipe.yaml')"),
    (file_and_folder, "is listed as a file and as the folder of"),
    (signatures_sealed, "'signatures.json' is never sealed"),
])
def test_a_manifest_naming_a_file_two_ways_is_refused_when_loaded(pristine, tmp_path, edit,
                                                                  says):
    bundle = resealed(copy_of(pristine, tmp_path), edit)
    with pytest.raises(BundleError, match="manifest field files"):
        read_manifest(bundle)
    for command in (["verify"], ["run", "--prompt", "x", "--max-new-tokens", "1"]):
        result = cli(command[0], bundle, *command[1:])
        assert result.exit_code == 1 and says in result.output, (command, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_number_longer_than_the_int_parser_takes_is_a_corrupted_manifest(pristine, tmp_path):
    bundle = copy_of(pristine, tmp_path)
    text = (bundle / MANIFEST).read_text()
    (bundle / MANIFEST).write_text(text.replace('"ctx_len": ', '"ctx_len": ' + "9" * 5000, 1))
    for command in (["verify"], ["run", "--prompt", "x"], ["inspect"]):
        result = cli(command[0], bundle, *command[1:])
        assert result.exit_code == 1, (command, result.output)
        assert "corrupted manifest" in result.output and "4300 digits" in result.output


# ---------------------------------------------------------------- keys and signature files
@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("keys")
    assert cli("keygen", folder / "k").exit_code == 0
    return folder


def test_a_key_that_is_a_device_or_folder_is_refused_without_reading_it(pristine, keys):
    for key, says in (("/dev/zero", "not a regular file"), (keys, "not a regular file"),
                      (keys / "missing.pub", "no such file")):
        result = cli_process("verify", pristine, "--key", key)
        assert result.returncode == 2, (key, result.stderr)
        assert f"--key {key}: {says}" in result.stdout + result.stderr
        assert "Traceback" not in result.stderr


def test_a_fifo_signature_file_is_refused_not_waited_on(pristine, keys, tmp_path):
    bundle = copy_of(pristine, tmp_path)
    os.mkfifo(bundle / "signatures.json")
    for argv in (["verify", bundle, "--key", keys / "k.pub"],
                 ["run", bundle, "--prompt", "x", "--require-signature", keys / "k.pub"]):
        result = cli_process(*argv)
        assert result.returncode == 1, (argv, result.stderr)
        assert "signatures.json: not a regular file" in result.stdout + result.stderr


def test_a_signature_in_an_unknown_algorithm_is_refused_naming_it(pristine, keys, tmp_path):
    bundle = copy_of(pristine, tmp_path)
    assert cli("sign", bundle, "--key", keys / "k").exit_code == 0
    entries = json.loads((bundle / "signatures.json").read_text())
    entries["signatures"][0]["algorithm"] = "rot13"
    (bundle / "signatures.json").write_text(json.dumps(entries))
    result = cli("verify", bundle, "--key", keys / "k.pub")
    assert result.exit_code == 1 and "signature algorithm 'rot13' is not supported" \
        in result.output, result.output


# ---------------------------------------------------------------- tiny temperatures
def test_a_temperature_too_small_for_float32_samples_greedy_with_ties():
    logits = np.array([[1.0, 3.0, 3.0, -2.0, 0.0] + [-1.0] * 300], dtype=np.float32)
    rng = np.random.default_rng(0)
    for temperature in (1e-300, 5e-324, 1e-40, 1e-36):
        p = probabilities(logits, SamplingParams(temperature))
        assert np.isfinite(p).all(), temperature
        assert p[0, 1] == p[0, 2] == 0.5 and p.sum() == 1.0, temperature
        drawn = {sample(p[0], rng) for _ in range(200)}
        assert drawn == {1, 2}, temperature  # both tied maxima, nothing else
        assert probabilities(logits, SamplingParams(temperature, top_k=1))[0, 1] == 1.0


def test_run_and_serve_at_a_tiny_temperature_give_the_greedy_text(pristine):
    argv = ["run", pristine, "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--json"]
    greedy = cli(*argv)
    tiny = cli(*argv, "--temperature", "1e-300", "--seed", "3")
    assert greedy.exit_code == 0 and tiny.exit_code == 0, tiny.output
    text = json.loads(greedy.stdout)["batches"][0]["outputs"][0]["text"]
    assert json.loads(tiny.stdout)["batches"][0]["outputs"][0]["text"] == text
    server = LiveServer(pristine)
    try:
        reply = server.client.completions.create(model=server.name, prompt="def add(a, b):",
                                                 max_tokens=8, temperature=1e-300)
        assert reply.choices[0].text == text
    finally:
        server.stop()


# ---------------------------------------------------------------- unpack through a link
def test_unpack_into_a_symlinked_folder_says_where_the_bundle_went(pristine, tmp_path):
    archive = tmp_path / "b.tar.gz"
    assert cli("package", pristine, "-o", archive).exit_code == 0
    target, link, dangling = tmp_path / "real", tmp_path / "link", tmp_path / "dangling"
    target.mkdir()
    link.symlink_to(target)
    dangling.symlink_to(tmp_path / "nowhere")
    result = cli("unpack", archive, "-d", link)
    assert result.exit_code == 0, result.output
    name = json.loads((pristine / MANIFEST).read_text())["name"]
    assert f"is a symbolic link to {target}" in result.output
    assert f"unpacked {target / name}" in result.output and (target / name / MANIFEST).is_file()
    result = cli("unpack", archive, "-d", dangling)
    assert result.exit_code == 2 and f"-d {dangling}: a symbolic link to" in result.output
    assert not (tmp_path / "nowhere").exists()

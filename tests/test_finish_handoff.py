"""The SDK hand-off as it runs on a real SDK machine: the compiler found on PATH by name, the
`qpcbuild` on PATH that compile.sh calls at its end, and one compile.sh per role run at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.bundle import read_manifest, verify_bundle
from qpcbuild.cli import app

from helpers_qaic import ROLES, StandIn, build

ROOT = Path(__file__).resolve().parents[1]
# The SDK's compilers are patched away in every test (no_qaic_sdk, conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_qaic_sdk")]
runner = CliRunner()


def sdk_path(tmp_path: Path) -> dict[str, str]:
    """A PATH holding `qaic-compile` (the recording stand-in) and `qpcbuild` (this tree)."""
    bin_dir = tmp_path / "sdk-bin"
    stand_in = StandIn(tmp_path / "stand-in")
    bin_dir.mkdir()
    (bin_dir / "qaic-compile").symlink_to(stand_in.path)
    wrapper = bin_dir / "qpcbuild"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m qpcbuild \"$@\"\n")
    wrapper.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "QAIC_COMPILER": "qaic-compile"}


@pytest.mark.parametrize("round_", range(3))
def test_two_compile_sh_in_parallel_with_the_compiler_on_path_both_get_adopted(
        qaic_recipe, tmp_path, round_):
    out = tmp_path / "bundle"
    build(qaic_recipe, tmp_path / "cache", out, emit_only=True)
    env = sdk_path(tmp_path)
    procs = [subprocess.Popen([str(out / role / "qaic" / "compile.sh")], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ROLES]
    for proc in procs:
        output = proc.communicate(timeout=180)[0]
        assert proc.returncode == 0 and "Traceback" not in output, output
    m = read_manifest(out).to_json_dict()
    for role in ROLES:
        entry = m["roles"][role]["backends"]["qaic"]
        assert entry["status"] == "compiled", (role, entry)
        assert entry["compiler"]["name"] == "qaic-compile"  # resolved through PATH
        assert f"{role}/qpc/programqpc.bin" in m["files"]
    assert verify_bundle(out) == []


@pytest.mark.parametrize("compiler, says", [
    ("no-such-qaic-compile", "not on PATH"),
    ("{tmp}", "is a folder"),
    ("{tmp}/missing/qaic-compile", "No such file"),
    ("/dev/zero", "not a regular file"),
    ("{tmp}/not-executable", "not executable"),
])
def test_finish_refuses_a_compiler_that_cannot_be_one_quickly(qaic_recipe, tmp_path, compiler,
                                                              says):
    out = tmp_path / "bundle"
    build(qaic_recipe, tmp_path / "cache", out, emit_only=True)
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    before = (out / "manifest.json").read_bytes()
    result = runner.invoke(app, ["finish", str(out), "--compiler",
                                 compiler.format(tmp=tmp_path)])
    assert result.exit_code == 2 and says in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert (out / "manifest.json").read_bytes() == before


def test_compile_finds_a_compiler_named_on_path(qaic_recipe, tmp_path, monkeypatch):
    env = sdk_path(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    result = build(qaic_recipe, tmp_path / "cache", tmp_path / "bundle", compiler="qaic-compile")
    entry = read_manifest(result.bundle).to_json_dict()["roles"]["target"]["backends"]["qaic"]
    assert entry["status"] == "compiled" and entry["compiler"]["name"] == "qaic-compile"

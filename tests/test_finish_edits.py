"""`finish` after `compile --emit-only` must seal only what the manifest sealed before: a byte
flipped (same size) in a graph, its weights, the compiler's inputs or the ORT model is found by
digest and named, and nothing is written. And a finish of one role must not leave another
role's QPC as an unsealed file that `verify` rejects. The qaic compiler is the recording
stand-in of helpers_qaic.py, run by the bundle's own compile.sh."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.bundle import read_manifest, verify_bundle
from qpcbuild.cli import app

from helpers_qaic import ROLES, StandIn, build

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_qaic_sdk")]
runner = CliRunner()


def emitted_and_compiled(recipe: Path, tmp_path: Path, roles=ROLES) -> Path:
    """An --emit-only bundle whose compile.sh ran for `roles` on a machine without qpcbuild on
    PATH (so no finish ran yet)."""
    out = tmp_path / "bundle"
    build(recipe, tmp_path / "cache", out, emit_only=True)
    env = {**os.environ, "PATH": "/usr/bin:/bin",
           "QAIC_COMPILER": str(StandIn(tmp_path / "stand-in").path)}
    for role in roles:
        done = subprocess.run(["bash", str(out / role / "qaic" / "compile.sh")], env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    return out


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("edited", ["target/onnx/model.onnx", "target/onnx/model.onnx.data",
                                    "target/qaic/specializations.json",
                                    "target/ort/model.onnx"])
def test_finish_refuses_a_bundle_with_a_flipped_byte_naming_the_file(qaic_recipe, tmp_path,
                                                                     edited):
    out = emitted_and_compiled(qaic_recipe, tmp_path, roles=["target"])
    size = (out / edited).stat().st_size
    flip_a_byte(out / edited)
    assert (out / edited).stat().st_size == size
    before = (out / "manifest.json").read_bytes()
    result = runner.invoke(app, ["finish", str(out), "--role", "target"])
    assert result.exit_code == 1, result.output
    assert f"changed file: {edited} (sha256 differs from the manifest)" in result.output
    assert (out / "manifest.json").read_bytes() == before


def test_finishing_one_role_adopts_the_other_roles_compiled_qpc(qaic_recipe, tmp_path):
    out = emitted_and_compiled(qaic_recipe, tmp_path)
    result = runner.invoke(app, ["finish", str(out), "--role", "target"])
    assert result.exit_code == 0, result.output
    assert verify_bundle(out) == []
    m = read_manifest(out)
    assert {r: m.roles[r].backends["qaic"].status for r in ROLES} == \
        {r: "compiled" for r in ROLES}
    # The other role's own finish, run later, records the same QPC again.
    assert runner.invoke(app, ["finish", str(out), "--role", "draft"]).exit_code == 0
    assert verify_bundle(out) == []

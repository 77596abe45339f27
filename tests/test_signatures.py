"""Signatures say who built a bundle: `sign` / `verify --key` / `run --require-signature`,
against forged, stripped, wrong-key and stale signatures."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.bundle.manifest import read_manifest, write_manifest
from qpcbuild.cli import app

from helpers_server import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """(bundle signed by key a, keys folder with a, a.pub, b, b.pub)."""
    tmp = tmp_path_factory.mktemp("signed")
    result = runner.invoke(app, ["compile", str(ROOT / "recipes" / "demo.yaml"), "-o",
                                 str(tmp / "bundle"), "--cache-dir", str(tmp / "cache")])
    assert result.exit_code == 0, result.output
    for name in ("a", "b"):
        assert runner.invoke(app, ["keygen", str(tmp / name)]).exit_code == 0
    assert oct((tmp / "a").stat().st_mode & 0o777) == "0o600"
    before = read_manifest(tmp / "bundle").bundle_id
    result = runner.invoke(app, ["sign", str(tmp / "bundle"), "--key", str(tmp / "a")])
    assert result.exit_code == 0, result.output
    assert read_manifest(tmp / "bundle").bundle_id == before  # signing leaves the id alone
    return tmp / "bundle", tmp


def copy_of(bundle: Path, tmp: Path) -> Path:
    out = tmp / "copy"
    shutil.copytree(bundle, out)
    return out


def run(bundle: Path, *extra: str):
    return runner.invoke(app, ["run", str(bundle), "--prompt", "def f", "--max-new-tokens", "2",
                               *extra])


def test_a_valid_signature_is_accepted_by_verify_and_run(signed):
    bundle, keys = signed
    result = runner.invoke(app, ["verify", str(bundle), "--key", str(keys / "a.pub")])
    assert result.exit_code == 0 and "signed by" in result.output, result.output
    assert run(bundle, "--require-signature", str(keys / "a.pub")).exit_code == 0


def test_wrong_key_is_refused(signed):
    bundle, keys = signed
    result = runner.invoke(app, ["verify", str(bundle), "--key", str(keys / "b.pub")])
    assert result.exit_code == 1 and "no signature by the key" in result.output
    result = run(bundle, "--require-signature", str(keys / "b.pub"))
    assert result.exit_code == 1 and "no signature by the key" in result.output


def test_stripped_signature_is_refused(signed, tmp_path):
    bundle, keys = signed
    copy = copy_of(bundle, tmp_path)
    (copy / "signatures.json").unlink()
    assert runner.invoke(app, ["verify", str(copy)]).exit_code == 0  # still intact, unsigned
    result = run(copy, "--require-signature", str(keys / "a.pub"))
    assert result.exit_code == 1 and "no signature" in result.output, result.output


def test_forged_signature_is_refused(signed, tmp_path):
    """Key a's id, bytes of a signature that key a never made."""
    bundle, keys = signed
    copy = copy_of(bundle, tmp_path)
    doc = json.loads((copy / "signatures.json").read_text())
    raw = bytearray(base64.b64decode(doc["signatures"][0]["signature"]))
    raw[0] ^= 0xFF
    doc["signatures"][0]["signature"] = base64.b64encode(bytes(raw)).decode()
    (copy / "signatures.json").write_text(json.dumps(doc))
    result = run(copy, "--require-signature", str(keys / "a.pub"))
    assert result.exit_code == 1 and "does not match this bundle" in result.output


def test_a_resealed_edit_keeps_no_valid_signature(signed, tmp_path):
    """The attack the seal cannot stop: edit, re-seal, keep the old signature file."""
    bundle, keys = signed
    copy = copy_of(bundle, tmp_path)
    write_manifest(copy, read_manifest(copy).model_copy(update={"name": "trojan"}))
    assert runner.invoke(app, ["verify", str(copy)]).exit_code == 0  # the seal is fine
    result = runner.invoke(app, ["verify", str(copy), "--key", str(keys / "a.pub")])
    assert result.exit_code == 1 and "does not match this bundle" in result.output


def test_signing_needs_an_intact_bundle_and_a_private_key(signed, tmp_path):
    bundle, keys = signed
    copy = copy_of(bundle, tmp_path)
    (copy / "recipe.yaml").write_text("changed\n")
    result = runner.invoke(app, ["sign", str(copy), "--key", str(keys / "a")])
    assert result.exit_code == 1 and "not signed" in result.output
    result = runner.invoke(app, ["sign", str(bundle), "--key", str(keys / "a.pub")])
    assert result.exit_code == 2 and "private key" in result.output
    result = run(bundle, "--require-signature", str(keys / "a.pub"), "--verify", "fast")
    assert result.exit_code == 2 and "full" in result.output


def test_serve_refuses_an_unsigned_bundle(signed, tmp_path):
    bundle, keys = signed
    copy = copy_of(bundle, tmp_path)
    (copy / "signatures.json").unlink()
    r = subprocess.run([sys.executable, "-m", "qpcbuild", "serve", str(copy), "--port",
                        str(free_port()),
                        "--require-signature", str(keys / "a.pub")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and "no signature" in r.stderr and "Traceback" not in r.stderr

"""`pull` does not fetch what this machine already has (issue 48): a second pull of the same
bundle is "up to date" without a download, and a pull interrupted by a failure resumes from the
blobs it had verified. The oracle is the registry's own storage: a blob removed from it cannot
have been downloaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.bundle import read_manifest
from qpcbuild.cli import app
from qpcbuild.tree import hash_tree
from helpers_registry import push

# oci_registry and registry_demo_bundle are session fixtures (conftest.py).
pytestmark = pytest.mark.slow
runner = CliRunner()
BIG = "target/ort/model.onnx.data"  # the largest file: downloaded in the pull's own thread


def pull(ref: str, out: Path) -> dict:
    result = runner.invoke(app, ["pull", ref, "-d", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


class Hidden:
    """Blobs taken out of the registry's storage for a while (put back on exit)."""

    def __init__(self, registry, bundle: Path, *rels: str):
        files = read_manifest(bundle).file_list()
        self.blobs = {registry.blob_path(files[rel]["sha256"]): None for rel in rels}

    def __enter__(self):
        for blob in self.blobs:
            self.blobs[blob] = blob.read_bytes()
            blob.unlink()
        return self

    def __exit__(self, *exc):
        for blob, data in self.blobs.items():
            blob.write_bytes(data)


def test_pulling_an_identical_bundle_again_is_up_to_date_without_a_download(
        oci_registry, registry_demo_bundle, tmp_path):
    ref = f"{oci_registry.address}/team/again:v1"
    push(registry_demo_bundle, ref)
    out = tmp_path / "demo"
    first = pull(ref, out)
    assert not first["up_to_date"] and first["downloaded_bytes"] > 0
    files = [rel for rel in read_manifest(registry_demo_bundle).file_list()]
    with Hidden(oci_registry, registry_demo_bundle, *files):  # nothing left to download
        second = runner.invoke(app, ["pull", ref, "-d", str(out)])
    assert second.exit_code == 0, second.output
    assert f"{out} is up to date with {ref}" in " ".join(second.output.split())
    assert hash_tree(out) == hash_tree(registry_demo_bundle)


def test_a_changed_file_in_the_destination_is_downloaded_again(oci_registry,
                                                               registry_demo_bundle, tmp_path):
    ref = f"{oci_registry.address}/team/again:v1"
    push(registry_demo_bundle, ref)
    out = tmp_path / "demo"
    pull(ref, out)
    data = bytearray((out / BIG).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    (out / BIG).write_bytes(bytes(data))
    again = pull(ref, out)
    assert not again["up_to_date"]
    assert again["downloaded_bytes"] == (registry_demo_bundle / BIG).stat().st_size
    assert hash_tree(out) == hash_tree(registry_demo_bundle)


def test_a_failed_pull_resumes_from_the_blobs_it_verified(oci_registry, registry_demo_bundle,
                                                          tmp_path):
    ref = f"{oci_registry.address}/team/resume:v1"
    push(registry_demo_bundle, ref)
    out = tmp_path / "demo"
    with Hidden(oci_registry, registry_demo_bundle, "recipe.yaml"):  # fails after BIG arrived
        failed = runner.invoke(app, ["pull", ref, "-d", str(out)])
    assert failed.exit_code != 0 and not out.exists()
    assert "Traceback" not in failed.output
    with Hidden(oci_registry, registry_demo_bundle, BIG):  # now only the kept copy has it
        resumed = runner.invoke(app, ["pull", ref, "-d", str(out)])
    assert resumed.exit_code == 0, resumed.output
    assert f"{BIG}: kept from an interrupted pull (verified), not downloaded" in resumed.output
    # byte progress with a rate, as a log sees it
    assert re.search(rf"pulling \d+ files from {oci_registry.address}/team/resume: [\d.]+ MB in "
                     r"[\d.]+ s \([\d.]+ [kMG]?B/s\)", resumed.output), resumed.output
    assert hash_tree(out) == hash_tree(registry_demo_bundle)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo.lock", "demo"]  # kept: gone

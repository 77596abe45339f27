"""Signatures through a real OCI registry (Debian's docker-registry 2.8, which has no referrers
API, so the OCI 1.1 tag-schema fallback is what is exercised): push attaches signatures.json as
a referrer of the bundle's manifest, pull brings it back, and `pull --require-signature` refuses
unsigned, wrong-key and forged-referrer bundles, leaving nothing behind."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from qpcbuild.cli import app
from qpcbuild.registry.client import RegistryClient

from helpers_registry import push

# oci_registry and registry_demo_bundle are session fixtures (conftest.py), shared with
# test_registry.py.
pytestmark = pytest.mark.slow
runner = CliRunner()
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("keys")
    for name in ("a", "b"):
        assert runner.invoke(app, ["keygen", str(folder / name)]).exit_code == 0
    return folder


@pytest.fixture(scope="module")
def signed_bundle(registry_demo_bundle, keys, tmp_path_factory) -> Path:
    bundle = tmp_path_factory.mktemp("signed") / "demo"
    shutil.copytree(registry_demo_bundle, bundle)
    result = runner.invoke(app, ["sign", str(bundle), "--key", str(keys / "a")])
    assert result.exit_code == 0, result.output
    return bundle


def pull(ref: str, out: Path, *extra: str):
    return runner.invoke(app, ["pull", ref, "-d", str(out), *extra])


def get(registry, path: str, accept: str) -> httpx.Response:
    resp = httpx.get(f"http://{registry.address}/v2/{path}", headers={"Accept": accept})
    assert resp.status_code == 200, resp.text
    return resp


def test_push_attaches_signatures_as_a_referrer_in_the_tag_schema(oci_registry, signed_bundle):
    ref = f"{oci_registry.address}/sig/demo:v1"
    result = runner.invoke(app, ["push", str(signed_bundle), ref])
    assert result.exit_code == 0, result.output
    assert "1 signature(s) attached" in result.output
    digest = result.stdout.strip().splitlines()[-1]
    subject = get(oci_registry, f"sig/demo/manifests/{digest}", MANIFEST).content
    # The spec's fallback: an image index under the tag <alg>-<hex> of the subject.
    index = get(oci_registry, f"sig/demo/manifests/{digest.replace(':', '-')}", INDEX).json()
    assert index["mediaType"] == INDEX and len(index["manifests"]) == 1
    entry = index["manifests"][0]
    assert entry["artifactType"] == "application/vnd.qpcbuild.signatures.v1+json"
    raw = get(oci_registry, f"sig/demo/manifests/{entry['digest']}", MANIFEST).content
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == entry["digest"]
    assert entry["size"] == len(raw)
    referrer = json.loads(raw)
    assert referrer["subject"] == {"mediaType": MANIFEST, "digest": digest,
                                   "size": len(subject)}
    assert referrer["config"] == {"mediaType": "application/vnd.oci.empty.v1+json",
                                  "digest": "sha256:" + hashlib.sha256(b"{}").hexdigest(),
                                  "size": 2}
    [layer] = referrer["layers"]
    blob = get(oci_registry, f"sig/demo/blobs/{layer['digest']}", "*/*").content
    assert blob == (signed_bundle / "signatures.json").read_bytes()
    # Pushing again does not list the same referrer twice.
    assert runner.invoke(app, ["push", str(signed_bundle), ref, "-q"]).exit_code == 0
    again = get(oci_registry, f"sig/demo/manifests/{digest.replace(':', '-')}", INDEX).json()
    assert again["manifests"] == index["manifests"]


def test_pull_require_signature_with_the_right_key(oci_registry, signed_bundle, keys, tmp_path):
    ref = f"{oci_registry.address}/sig/demo:v2"
    push(signed_bundle, ref)
    out = tmp_path / "pulled"
    result = pull(ref, out, "--require-signature", str(keys / "a.pub"))
    assert result.exit_code == 0, result.output
    assert "signed by" in result.output
    assert (out / "signatures.json").read_bytes() == \
        (signed_bundle / "signatures.json").read_bytes()
    verified = runner.invoke(app, ["verify", str(out), "--key", str(keys / "a.pub")])
    assert verified.exit_code == 0, verified.output
    # Without the option the signatures come back all the same.
    plain = tmp_path / "plain"
    assert pull(ref, plain).exit_code == 0
    assert runner.invoke(app, ["verify", str(plain), "--key",
                               str(keys / "a.pub")]).exit_code == 0


def test_unsigned_and_wrong_key_are_refused_leaving_nothing(oci_registry, registry_demo_bundle,
                                                            signed_bundle, keys, tmp_path):
    push(registry_demo_bundle, f"{oci_registry.address}/sig/unsigned:v1")
    push(signed_bundle, f"{oci_registry.address}/sig/demo:v3")
    for ref, key in ((f"{oci_registry.address}/sig/unsigned:v1", "a.pub"),
                     (f"{oci_registry.address}/sig/demo:v3", "b.pub")):
        out = tmp_path / key / "pulled"
        result = pull(ref, out, "--require-signature", str(keys / key))
        assert result.exit_code == 1, result.output
        assert "no signature by the key" in result.output and "Traceback" not in result.output
        assert not out.exists() and os.listdir(out.parent) == []


def test_a_forged_signature_referrer_is_refused(oci_registry, registry_demo_bundle, signed_bundle,
                                                keys, tmp_path):
    """A referrer pushed by hand (not through qpcbuild's own attach): key a's id, signature
    bytes key a never made, attached to an unsigned bundle."""
    address, repo = oci_registry.address, "sig/forged"
    digest = push(registry_demo_bundle, f"{address}/{repo}:v1")
    entry = json.loads((signed_bundle / "signatures.json").read_text())["signatures"][0]
    forged = json.dumps({"signatures": [{**entry, "signature": base64.b64encode(
        bytes(64)).decode()}]}).encode()
    subject = get(oci_registry, f"{repo}/manifests/{digest}", MANIFEST).content
    with RegistryClient(address) as client:
        for blob in (b"{}", forged):
            client.push_blob(repo, "sha256:" + hashlib.sha256(blob).hexdigest(), len(blob),
                             data=blob)
        referrer = {"schemaVersion": 2, "mediaType": MANIFEST,
                    "artifactType": "application/vnd.qpcbuild.signatures.v1+json",
                    "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                               "digest": "sha256:" + hashlib.sha256(b"{}").hexdigest(),
                               "size": 2},
                    "layers": [{"mediaType": "application/vnd.qpcbuild.signatures.v1+json",
                                "digest": "sha256:" + hashlib.sha256(forged).hexdigest(),
                                "size": len(forged)}],
                    "subject": {"mediaType": MANIFEST, "digest": digest,
                                "size": len(subject)}}
        raw = json.dumps(referrer).encode()
        resp = httpx.put(f"http://{address}/v2/{repo}/manifests/sha256:"
                         + hashlib.sha256(raw).hexdigest(), content=raw,
                         headers={"Content-Type": MANIFEST})
        assert resp.status_code == 201, resp.text
        index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": [
            {"mediaType": MANIFEST, "digest": "sha256:" + hashlib.sha256(raw).hexdigest(),
             "size": len(raw), "artifactType": referrer["artifactType"]}]}
        client.put_manifest(repo, digest.replace(":", "-"), index, INDEX)
    out = tmp_path / "pulled"
    result = pull(f"{address}/{repo}:v1", out, "--require-signature", str(keys / "a.pub"))
    assert result.exit_code == 1, result.output
    assert "does not match this bundle" in result.output
    assert not out.exists()
    # The same referrer without the option: the bundle comes with it, and verify --key says no.
    assert pull(f"{address}/{repo}:v1", out).exit_code == 0
    verified = runner.invoke(app, ["verify", str(out), "--key", str(keys / "a.pub")])
    assert verified.exit_code == 1 and "does not match" in verified.output
    # The genuine signature pushed beside it (same manifest: signing leaves the bundle alone)
    # is added to the index, not put in the forged one's place, and it is what counts.
    assert push(signed_bundle, f"{address}/{repo}:v1") == digest
    index = get(oci_registry, f"{repo}/manifests/{digest.replace(':', '-')}", INDEX).json()
    assert len(index["manifests"]) == 2
    again = tmp_path / "again"
    result = pull(f"{address}/{repo}:v1", again, "--require-signature", str(keys / "a.pub"))
    assert result.exit_code == 0, result.output


def test_run_takes_a_reference_with_require_signature(oci_registry, signed_bundle,
                                                      registry_demo_bundle, keys, tmp_path,
                                                      monkeypatch):
    """Both pushes are one manifest digest (signing leaves the bundle alone), so the store
    holds one copy: pulled unsigned first, it must pick up the signature attached in the other
    repository when a signature is required."""
    monkeypatch.setenv("QPCBUILD_STORE", str(tmp_path / "store"))
    push(signed_bundle, f"{oci_registry.address}/sig/run:v1")
    push(registry_demo_bundle, f"{oci_registry.address}/sig/run-unsigned:v1")
    args = ["--require-signature", str(keys / "a.pub"), "--prompt", "w1 w2", "--max-new-tokens",
            "2", "--json"]
    refused = runner.invoke(app, ["run", f"{oci_registry.address}/sig/run-unsigned:v1", *args])
    assert refused.exit_code == 1 and "no signature by the key" in refused.output
    ran = runner.invoke(app, ["run", f"{oci_registry.address}/sig/run:v1", *args])
    assert ran.exit_code == 0, ran.output
    assert "pulling" not in ran.output  # the store's copy, its signatures brought up to date

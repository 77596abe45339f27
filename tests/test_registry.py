"""Bundles through a real OCI registry (Debian's docker-registry, started per module on a free
loopback port): push/pull round trips, layers stored once, damaged blobs and killed pulls
refused or cleaned up, credentials from the environment, Docker's config file and a credential
helper, and references taken by run/inspect/verify. Built on the shipped demo pair."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from qpcbuild.bundle import read_manifest, verify_bundle
from qpcbuild.bundle.manifest import MANIFEST, content_id, _field_digests
from qpcbuild.cli import app
from qpcbuild.registry.client import RegistryClient
from qpcbuild.registry.credentials import Credentials
from qpcbuild.tree import hash_tree
from helpers_registry import compile_demo, push
from qpcbuild.testing import RegistryServer, free_port
from registry_server import start_registry

# oci_registry, registry_demo_bundle and demo_checkout are session fixtures (conftest.py).
pytestmark = pytest.mark.slow
QPCBUILD = [sys.executable, "-m", "qpcbuild"]
runner = CliRunner()


def oci_manifest(registry: RegistryServer, repo: str, ref: str) -> tuple[dict, int]:
    resp = httpx.get(f"http://{registry.address}/v2/{repo}/manifests/{ref}",
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert resp.status_code == 200, resp.text
    return resp.json(), len(resp.content)


# ---------------------------------------------------------------- push and pull
def test_push_pull_round_trip_is_byte_equal_by_tag_and_by_digest(oci_registry, registry_demo_bundle,
                                                                 tmp_path):
    ref = f"{oci_registry.address}/team/demo:v1"
    digest = push(registry_demo_bundle, ref)
    assert digest.startswith("sha256:") and len(digest) == 71
    # The same bundle pushed again is the same manifest, and nothing is uploaded.
    again = runner.invoke(app, ["push", str(registry_demo_bundle), ref, "--json"])
    assert json.loads(again.stdout)["digest"] == digest
    assert json.loads(again.stdout)["transferred_bytes"] == 0
    for source in (ref, f"{oci_registry.address}/team/demo@{digest}"):
        out = tmp_path / source.rsplit("/", 1)[-1].replace(":", "-").replace("@", "-")
        result = runner.invoke(app, ["pull", source, "-d", str(out), "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["bundle_id"] == \
            read_manifest(registry_demo_bundle).bundle_id
        # every file, byte for byte, and modes
        assert hash_tree(out) == hash_tree(registry_demo_bundle)
        assert verify_bundle(out) == []


def test_the_artifact_is_what_stock_oras_expects(oci_registry, registry_demo_bundle):
    push(registry_demo_bundle, f"{oci_registry.address}/team/oras:v1")
    m, _ = oci_manifest(oci_registry, "team/oras", "v1")
    sealed = read_manifest(registry_demo_bundle).to_json_dict()
    titles = {layer["annotations"]["org.opencontainers.image.title"]: layer
              for layer in m["layers"]}
    assert set(titles) == set(sealed["files"]) | {MANIFEST}  # one layer per file
    for rel, layer in titles.items():
        expected = hashlib.sha256((registry_demo_bundle / rel).read_bytes()).hexdigest()
        assert layer["digest"] == f"sha256:{expected}"
    assert m["config"]["mediaType"] == "application/vnd.qpcbuild.bundle.manifest.v1+json"
    assert m["config"]["digest"] == titles[MANIFEST]["digest"]
    a = m["annotations"]
    assert a["vnd.qpcbuild.bundle.id"] == sealed["bundle_id"]
    assert a["vnd.qpcbuild.bundle.name"] == "demo"
    assert a["vnd.qpcbuild.bundle.method"] == "draft_model"
    assert a["vnd.qpcbuild.bundle.ks"] == "0,4"
    assert json.loads(a["vnd.qpcbuild.bundle.toolchain"]) == sealed["toolchain"]


def test_a_layer_shared_by_two_bundles_is_stored_once(demo_checkout, tmp_path_factory):
    server = start_registry(tmp_path_factory.mktemp("registry-dedup"))
    try:
        root = tmp_path_factory.mktemp("dedup")
        a, b = root / "a", root / "b"
        cache = root / "cache"
        compile_demo(demo_checkout, a, cache)
        # B differs only in its draft (the target model drafting for itself).
        compile_demo(demo_checkout, b, cache, "--set", "draft.model=../models/demo/target")
        push(a, f"{server.address}/team/pair:a")
        stored_a = server.blob_bytes()
        push(b, f"{server.address}/team/pair:b")
        files_a, files_b = read_manifest(a).file_list(), read_manifest(b).file_list()
        known = {f["sha256"] for f in files_a.values()}
        new_in_b = {f["sha256"]: f["size"] for f in files_b.values() if f["sha256"] not in known}
        _, manifest_size = oci_manifest(server, "team/pair", "b")
        expected = sum(new_in_b.values()) + (b / MANIFEST).stat().st_size + manifest_size
        assert server.blob_bytes() - stored_a == expected
        target_graph = files_a["target/ort/model.onnx.data"]
        assert files_b["target/ort/model.onnx.data"] == target_graph
        assert target_graph["sha256"] not in new_in_b and target_graph["size"] > 1 << 20
    finally:
        server.stop()


def test_a_tampered_blob_in_the_registry_is_refused_on_pull(oci_registry, registry_demo_bundle,
                                                            tmp_path):
    ref = f"{oci_registry.address}/team/tampered:v1"
    push(registry_demo_bundle, ref)
    digest = read_manifest(registry_demo_bundle).file_list()["target/ort/model.onnx.data"]["sha256"]
    blob = oci_registry.blob_path(digest)
    original = blob.read_bytes()
    try:
        with open(blob, "r+b") as f:  # one byte, same size: only the digest can tell
            f.seek(len(original) // 2)
            f.write(bytes([original[len(original) // 2] ^ 0xFF]))
        out = tmp_path / "pulled"
        result = runner.invoke(app, ["pull", ref, "-d", str(out)])
        assert result.exit_code == 1
        assert "target/ort/model.onnx.data" in result.output and "digest" in result.output
        assert "Traceback" not in result.output
        assert not out.exists() and only_verified_blobs_kept(tmp_path, "pulled")
    finally:
        blob.write_bytes(original)


def only_verified_blobs_kept(folder: Path, name: str) -> bool:
    """A failed pull into folder/name leaves nothing but the blobs it finished, each named by
    its own digest, and the first bytes of one it was cut off in (DIGEST.part), for the next
    pull to resume from."""
    left = list(folder.iterdir())
    kept = folder / f".{name}.partial"
    assert set(left) <= {kept}, left
    found = list(kept.iterdir()) if kept.exists() else []
    return all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name for p in found
               if not p.name.endswith(".part"))


def _resealed_with_big_file(bundle: Path, dest: Path, size: int) -> Path:
    """The bundle plus a large file (sealed into its manifest), so a pull takes a while."""
    shutil.copytree(bundle, dest)
    big = dest / "aaa-big.bin"  # sorts first: it is downloaded first
    with open(big, "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
    m = json.loads((dest / MANIFEST).read_text())
    m["files"]["aaa-big.bin"] = {"size": big.stat().st_size,
                                 "sha256": hashlib.sha256(big.read_bytes()).hexdigest()}
    m["bundle_id"] = content_id(m)
    m["seal"]["fields"] = _field_digests(m)
    (dest / MANIFEST).write_text(json.dumps(m, indent=1))
    assert verify_bundle(dest) == []
    return dest


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_pull_killed_midway_leaves_nothing(oci_registry, registry_demo_bundle, tmp_path, how):
    ref = f"{oci_registry.address}/team/big:v1"
    if how == signal.SIGTERM:  # pushed once for the three kills
        push(_resealed_with_big_file(registry_demo_bundle, tmp_path / "big", 384 << 20), ref)
    dest_root = tmp_path / "dest"
    dest_root.mkdir()
    out = dest_root / "bundle"
    # A CI runner that starts its job in the background (`cmd &` in a script) hands it SIGINT
    # ignored, and Python then never turns Ctrl-C into KeyboardInterrupt: the pull gets the
    # default disposition back, as a terminal would give it.
    proc = subprocess.Popen([*QPCBUILD, "pull", ref, "-d", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size for p in dest_root.glob(".bundle.building-*/aaa-big.bin")):
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "the pull never started downloading"
        time.sleep(0.01)
    proc.send_signal(how)
    code = proc.wait(60)
    assert code == {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -9}[how]
    assert not out.exists()
    if how == signal.SIGKILL:  # nothing can clean up after SIGKILL: the next pull does
        assert list(dest_root.iterdir())
        result = runner.invoke(app, ["pull", ref, "-d", str(out)])
        assert result.exit_code == 0, result.output
        # and it goes on from the big file's bytes that had arrived, checked with the rest
        assert re.search(r"aaa-big.bin: resumed at byte [1-9][\d,]* of an interrupted pull "
                         r"\(verified\), [\d,]+ bytes downloaded", result.output), result.output
        assert verify_bundle(out) == []
        assert sorted(p.name for p in dest_root.iterdir()) == [".bundle.lock", "bundle"]
    else:
        assert only_verified_blobs_kept(dest_root, "bundle")


def test_pull_refuses_to_replace_a_folder_that_is_not_a_bundle(oci_registry, registry_demo_bundle,
                                                               tmp_path):
    ref = f"{oci_registry.address}/team/demo:v1"
    push(registry_demo_bundle, ref)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    result = runner.invoke(app, ["pull", ref, "-d", str(tmp_path / "notes")])
    assert result.exit_code == 2 and "not a qpcbuild bundle" in result.output
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine\n"


@pytest.mark.parametrize("ref,named", [
    ("demo:v1", "registry host written out"),
    ("localhost:5000/Team/demo:v1", "not a valid repository name"),
    ("localhost:5000/team/demo:-v1", "not a valid registry tag"),
    ("localhost:5000/team/demo@sha256:abc", "64 lowercase hex"),
])
def test_bad_references_are_named(ref, named, tmp_path):
    result = runner.invoke(app, ["pull", ref, "-d", str(tmp_path / "x")])
    assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output


def test_unknown_tag_and_unreachable_registry(oci_registry, tmp_path):
    result = runner.invoke(app, ["pull", f"{oci_registry.address}/team/demo:nosuchtag"])
    assert result.exit_code == 2 and "404" in result.output
    result = runner.invoke(app, ["pull", f"127.0.0.1:{free_port()}/team/demo:v1"])
    assert result.exit_code == 1 and "not reachable" in result.output


def test_push_refuses_a_bundle_that_does_not_verify(oci_registry, registry_demo_bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(registry_demo_bundle, copy)
    (copy / "recipe.yaml").write_text("changed\n")
    result = runner.invoke(app, ["push", str(copy), f"{oci_registry.address}/team/bad:v1"])
    assert result.exit_code == 1 and "recipe.yaml" in result.output
    assert httpx.get(f"http://{oci_registry.address}/v2/team/bad/tags/list").status_code == 404


def test_push_publishes_only_bytes_that_match_the_seal(oci_registry, registry_demo_bundle,
                                                       tmp_path):
    """A same-size edit passes the size check; the registry refuses its bytes."""
    copy = tmp_path / "copy"
    shutil.copytree(registry_demo_bundle, copy)
    text = (copy / "recipe.yaml").read_bytes()
    (copy / "recipe.yaml").write_bytes(text.replace(b"demo", b"dEmo", 1))
    result = runner.invoke(app, ["push", str(copy), f"{oci_registry.address}/team/flipped:v1"])
    assert result.exit_code == 1 and "recipe.yaml" in result.output
    assert "do not hash" in result.output and "Traceback" not in result.output
    assert httpx.get(f"http://{oci_registry.address}/v2/team/flipped/tags/list").status_code == 404


# ---------------------------------------------------------------- references as bundles
def test_run_inspect_verify_take_a_reference_and_reuse_the_store(oci_registry, registry_demo_bundle,
                                                                 tmp_path, monkeypatch):
    ref = f"{oci_registry.address}/team/demo:v1"
    digest = push(registry_demo_bundle, ref)
    monkeypatch.setenv("QPCBUILD_STORE", str(tmp_path / "store"))
    result = runner.invoke(app, ["verify", ref])
    assert result.exit_code == 0 and "pulling" in result.output, result.output
    stored = tmp_path / "store" / digest.replace(":", "-")
    assert hash_tree(stored) == hash_tree(registry_demo_bundle)
    inspected = runner.invoke(app, ["inspect", ref, "--json"])
    assert json.loads(inspected.stdout)["bundle_id"] == \
        read_manifest(registry_demo_bundle).bundle_id
    ran = runner.invoke(app, ["run", f"{oci_registry.address}/team/demo@{digest}", "--prompt",
                              "w1 w2 w3", "--max-new-tokens", "4", "--json"])
    assert ran.exit_code == 0, ran.output
    assert "pulling" not in ran.output  # reused the store's copy
    assert [p.name for p in (tmp_path / "store").iterdir() if not p.name.startswith(".")] \
        == [stored.name]


# ---------------------------------------------------------------- transport and credentials
def test_https_unless_loopback_or_insecure():
    assert RegistryClient("registry.example.com").base == "https://registry.example.com"
    assert RegistryClient("10.0.0.5:5000").base == "https://10.0.0.5:5000"
    assert RegistryClient("10.0.0.5:5000", insecure=True).base == "http://10.0.0.5:5000"
    for host in ("localhost:5000", "127.0.0.1:5000", "[::1]:5000"):
        assert RegistryClient(host).base.startswith("http://")


def test_secrets_stay_out_of_reprs():
    creds = Credentials("ci", "hunter2-secret", source="test")
    assert "hunter2" not in repr(creds)


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    server = start_registry(tmp_path_factory.mktemp("auth-registry"), "ci", "s3cret-pass")
    yield server
    server.stop()


def test_wrong_credentials_are_a_clear_error(auth_registry, registry_demo_bundle, tmp_path):
    ref = f"{auth_registry.address}/team/demo:v1"
    for env in ({"QPCBUILD_REGISTRY_USERNAME": "ci", "QPCBUILD_REGISTRY_PASSWORD": "wrong-pw"},
                {"DOCKER_CONFIG": str(tmp_path / "none")}):
        result = runner.invoke(app, ["push", str(registry_demo_bundle), ref], env=env)
        assert result.exit_code == 2, result.output
        assert auth_registry.address in result.output and "Traceback" not in result.output
        assert "wrong-pw" not in result.output
    result = runner.invoke(app, ["pull", ref, "-d", str(tmp_path / "x")],
                           env={"QPCBUILD_REGISTRY_USERNAME": "ci",
                                "QPCBUILD_REGISTRY_PASSWORD": "wrong-pw"})
    assert result.exit_code == 2 and "refused" in result.output and "as ci" in result.output


def test_credentials_from_env_docker_config_and_a_helper(auth_registry, registry_demo_bundle,
                                                         tmp_path, monkeypatch):
    ref = f"{auth_registry.address}/team/demo:v1"
    env = {"QPCBUILD_REGISTRY_USERNAME": "ci", "QPCBUILD_REGISTRY_PASSWORD": "s3cret-pass"}
    digest = push(registry_demo_bundle, ref, **env)
    # Docker's config file: base64 user:password under auths, keyed as `docker login` writes.
    config = tmp_path / "docker"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"auths": {
        f"https://{auth_registry.address}": {"auth": base64.b64encode(
            b"ci:s3cret-pass").decode()}}}))
    result = runner.invoke(app, ["pull", ref, "-d", str(tmp_path / "a"), "--json"],
                           env={"DOCKER_CONFIG": str(config)})
    assert result.exit_code == 0 and json.loads(result.stdout)["digest"] == digest
    # A credential helper: `docker-credential-NAME get`, host on stdin, JSON on stdout.
    helper_dir = tmp_path / "bin"
    helper_dir.mkdir()
    helper = helper_dir / "docker-credential-qpctest"
    helper.write_text("#!/bin/sh\nread host\n"
                      f"[ \"$host\" = \"{auth_registry.address}\" ] || exit 1\n"
                      "echo '{\"ServerURL\": \"'$host'\", \"Username\": \"ci\", "
                      "\"Secret\": \"s3cret-pass\"}'\n")
    helper.chmod(0o755)
    (config / "config.json").write_text(json.dumps({"credHelpers": {
        auth_registry.address: "qpctest"}}))
    monkeypatch.setenv("PATH", f"{helper_dir}:{os.environ['PATH']}")
    result = runner.invoke(app, ["pull", ref, "-d", str(tmp_path / "b")],
                           env={"DOCKER_CONFIG": str(config)})
    assert result.exit_code == 0, result.output
    assert hash_tree(tmp_path / "b") == hash_tree(registry_demo_bundle)


# ---------------------------------------------------------------- broken connections
class CuttingRelay:
    """A TCP relay in front of the registry that breaks one connection, once, after it has
    carried `cut_after` bytes in one direction ("down": responses, "up": requests); it keeps
    every request's bytes so a test can see how the client resumed."""

    def __init__(self, upstream: str, direction: str, cut_after: int):
        self.upstream, self.direction, self.cut_after = upstream, direction, cut_after
        self.cut = threading.Event()
        self.requests = bytearray()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            host, port = self.upstream.split(":")
            upstream = socket.create_connection((host, int(port)))
            for src, dst, way in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(target=self._pipe, args=(src, dst, way, (client, upstream)),
                                 daemon=True).start()

    def _pipe(self, src, dst, way, both) -> None:
        carried = 0
        try:
            while data := src.recv(1 << 16):
                if way == "up":
                    self.requests += data
                carried += len(data)
                if way == self.direction and carried > self.cut_after and \
                        not self.cut.is_set():
                    self.cut.set()
                    for s in both:
                        s.shutdown(socket.SHUT_RDWR)
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in both:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def test_a_broken_download_resumes_from_the_last_byte(oci_registry, registry_demo_bundle, tmp_path):
    push(registry_demo_bundle, f"{oci_registry.address}/team/resume:v1")
    relay = CuttingRelay(oci_registry.address, "down", 5 << 20)  # past the first 4 MiB piece
    try:
        result = runner.invoke(app, ["pull", f"{relay.address}/team/resume:v1", "-d",
                                     str(tmp_path / "out")])
    finally:
        relay.close()
    assert result.exit_code == 0, result.output
    assert relay.cut.is_set()
    resumed = re.findall(rb"[Rr]ange: bytes=(\d+)-", bytes(relay.requests))
    assert resumed and int(resumed[0]) > 0  # continued, not restarted
    assert hash_tree(tmp_path / "out") == hash_tree(registry_demo_bundle)


def test_a_broken_upload_is_sent_again(oci_registry, registry_demo_bundle, tmp_path):
    relay = CuttingRelay(oci_registry.address, "up", 3 << 20)
    try:
        result = runner.invoke(app, ["push", str(registry_demo_bundle),
                                     f"{relay.address}/team/up:v1"])
    finally:
        relay.close()
    assert result.exit_code == 0, result.output
    assert relay.cut.is_set()
    pulled = runner.invoke(app, ["pull", f"{oci_registry.address}/team/up:v1", "-d",
                                 str(tmp_path / "out")])
    assert pulled.exit_code == 0 and hash_tree(tmp_path / "out") == hash_tree(registry_demo_bundle)


def test_where_credentials_are_found_and_in_which_order(tmp_path, monkeypatch):
    from qpcbuild.errors import UsageError
    from qpcbuild.registry.credentials import find_credentials

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    monkeypatch.delenv("QPCBUILD_REGISTRY_USERNAME", raising=False)
    monkeypatch.delenv("QPCBUILD_REGISTRY_PASSWORD", raising=False)
    assert find_credentials("reg.example:5000") is None  # no config file: anonymous
    helper = tmp_path / "docker-credential-tok"
    helper.write_text("#!/bin/sh\nread host\necho '{\"Username\": \"<token>\", "
                      "\"Secret\": \"refresh-for-'$host'\"}'\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    config = {"auths": {"reg.example:5000": {"auth": base64.b64encode(b"u:p").decode()},
                        "https://other.example/v1/": {"identitytoken": "idt"}},
              "credHelpers": {"helped.example": "tok"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    found = find_credentials("reg.example:5000")
    assert (found.username, found.password) == ("u", "p") and "auths" in found.source
    assert find_credentials("other.example").identity_token == "idt"
    helped = find_credentials("helped.example")
    assert helped.identity_token == "refresh-for-helped.example" and helped.username is None
    monkeypatch.setenv("QPCBUILD_REGISTRY_USERNAME", "env-user")
    monkeypatch.setenv("QPCBUILD_REGISTRY_PASSWORD", "env-pass")
    assert find_credentials("reg.example:5000").username == "env-user"  # the environment wins
    monkeypatch.setenv("QPCBUILD_REGISTRY_HOST", "ci.example")  # scoped: not for other hosts
    assert find_credentials("reg.example:5000").username == "u"
    assert find_credentials("ci.example").username == "env-user"
    monkeypatch.delenv("QPCBUILD_REGISTRY_HOST")
    monkeypatch.delenv("QPCBUILD_REGISTRY_PASSWORD")
    with pytest.raises(UsageError, match="both"):
        find_credentials("reg.example:5000")
    monkeypatch.delenv("QPCBUILD_REGISTRY_USERNAME")
    config["auths"]["reg.example:5000"]["auth"] = "not base64!"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="base64"):
        find_credentials("reg.example:5000")
    (tmp_path / "config.json").write_text(json.dumps({"credsStore": "missing-helper"}))
    with pytest.raises(UsageError, match="docker-credential-missing-helper"):
        find_credentials("reg.example:5000")

"""`compile --push`: the bundle is sealed here and published to a registry, never written as a
folder; with `--remote-cache`, what the cache's registry holds is mounted into the bundle's
repository instead of being downloaded (a CI runner that assembles a bundle from remote hits
moves kilobytes, not the graphs). Against a real registry: the pushed bundle pulls, verifies
and has the bundle id of a plain folder build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.bundle import read_manifest, verify_bundle
from qpcbuild.cli import app
from helpers_registry import compile_json, demo_checkout, origins
from qpcbuild.testing import free_port
from registry_server import start_registry

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return demo_checkout(tmp_path_factory.mktemp("checkout"))


@pytest.fixture
def registries(tmp_path):
    servers = [start_registry(tmp_path / f"registry-{n}") for n in range(2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    # the staging folder goes where the folder would have: the recipe's output, build/demo
    monkeypatch.chdir(tmp_path)


def compile_push(recipe: Path, tmp: Path, cache: str, ref: str, *extra: str) -> dict:
    result = runner.invoke(app, ["compile", str(recipe), "--cache-dir", str(tmp / cache),
                                 "--push", ref, "--json", *extra])
    assert result.exit_code == 0, result.output
    assert list((tmp / "build").iterdir()) == []  # no folder, no staging left behind
    return json.loads(result.stdout)


def pulled(ref: str, dest: Path) -> str:
    result = runner.invoke(app, ["pull", ref, "-d", str(dest), "--json"])
    assert result.exit_code == 0, result.output
    assert verify_bundle(dest) == []
    return json.loads(result.stdout)["bundle_id"]


def cached(tmp: Path, cache: str) -> list[str]:
    return sorted(f"{p.parent.parent.name}/{p.parent.name}"
                  for p in (tmp / cache).glob("*/*/cache-entry.json"))


def test_a_runner_assembles_the_bundle_from_remote_hits_without_downloading_them(
        recipe, registries, tmp_path):
    reg = registries[0].address
    seed, _ = compile_json(recipe, tmp_path / "seed", tmp_path / "cache-seed",
                           "--remote-cache", f"{reg}/ci/cache")
    done = compile_push(recipe, tmp_path, "cache-b", f"{reg}/team/demo:v1",
                        "--remote-cache", f"{reg}/ci/cache")
    assert set(origins(done).values()) == {"remote"} and done["bundle"] is None
    pushed = done["pushed"]
    graphs = sum(f.size for p, f in read_manifest(tmp_path / "seed").files.items()
                 if "/ort/" in p)
    # The artifacts were mounted from the cache's repository: only the tokenizer, the recipe
    # and the manifest went up, and nothing came down into the runner's cache.
    assert pushed["bytes"] > graphs > 20 * pushed["transferred_bytes"]
    assert cached(tmp_path, "cache-b") == []
    assert pushed["pinned"].startswith(f"{reg}/team/demo@sha256:")
    assert done["bundle_id"] == seed["bundle_id"]
    assert pulled(pushed["pinned"], tmp_path / "pulled") == seed["bundle_id"]
    # The seeding runner's own cache holds every entry: they are mounted from the cache's
    # repository too, not uploaded again from its disk.
    local = compile_push(recipe, tmp_path, "cache-seed", f"{reg}/team/other:v1",
                         "--remote-cache", f"{reg}/ci/cache")
    assert set(origins(local).values()) == {"local"}
    assert local["pushed"]["transferred_bytes"] == pushed["transferred_bytes"]


def test_what_must_be_built_is_built_and_only_its_graph_is_downloaded(recipe, registries,
                                                                       tmp_path):
    reg = registries[0].address
    compile_json(recipe, tmp_path / "seed", tmp_path / "cache-seed",
                 "--remote-cache", f"{reg}/ci/cache")
    # int8 draft weights: a new ONNX Runtime key for the draft, the same exports
    int8 = ("--set", "onnxruntime.draft_weights=int8")
    local, _ = compile_json(recipe, tmp_path / "local", tmp_path / "cache-local", *int8)
    done = compile_push(recipe, tmp_path, "cache-b", f"{reg}/team/demo:int8",
                        "--remote-cache", f"{reg}/ci/cache", *int8)
    assert origins(done) == {"export target": "remote", "export draft": "remote",
                             "onnxruntime target": "remote", "onnxruntime draft": "built"}
    # the draft's graph came down to build from; the target's artifacts stayed in the registry
    kinds = [entry.split("/")[0] for entry in cached(tmp_path, "cache-b")]
    assert kinds == ["exports", "ort"]
    assert done["bundle_id"] == local["bundle_id"]
    assert pulled(f"{reg}/team/demo:int8", tmp_path / "pulled") == local["bundle_id"]


def test_pushing_to_another_registry_copies_the_cached_blobs(recipe, registries, tmp_path):
    cache_reg, other = registries[0].address, registries[1].address
    seed, _ = compile_json(recipe, tmp_path / "seed", tmp_path / "cache-seed",
                           "--remote-cache", f"{cache_reg}/ci/cache")
    done = compile_push(recipe, tmp_path, "cache-b", f"{other}/team/demo:v1",
                        "--remote-cache", f"{cache_reg}/ci/cache")
    # no mount across registries: every byte went through this runner, checked on the way
    assert done["pushed"]["transferred_bytes"] == done["pushed"]["bytes"]
    assert pulled(f"{other}/team/demo:v1", tmp_path / "pulled") == seed["bundle_id"]
    assert cached(tmp_path, "cache-b") == []


def test_without_a_remote_cache_the_push_reads_the_local_cache(recipe, registries, tmp_path):
    reg = registries[0].address
    folder, _ = compile_json(recipe, tmp_path / "folder", tmp_path / "cache")
    done = compile_push(recipe, tmp_path, "cache", f"{reg}/team/demo:v1")
    assert set(origins(done).values()) == {"local"}
    assert done["pushed"]["transferred_bytes"] == done["pushed"]["bytes"]
    assert pulled(f"{reg}/team/demo:v1", tmp_path / "pulled") == folder["bundle_id"]
    # without --json: what was pushed, and last the reference to pin
    again = runner.invoke(app, ["compile", str(recipe), "--cache-dir", str(tmp_path / "cache"),
                                "--push", f"{reg}/team/demo:v2"])
    assert again.exit_code == 0, again.output
    assert "0 uploaded" in again.stdout  # the registry has every blob already
    assert again.stdout.strip().splitlines()[-1] == done["pushed"]["pinned"]


def test_push_flags_that_contradict_are_refused_before_any_work(recipe, tmp_path):
    for argv, named in ((["--push", "localhost:5000/x/y:v1", "-o", str(tmp_path / "o")], "-o"),
                        (["--push", "localhost:5000/x/y:v1", "--unit", "0"], "--unit"),
                        (["--push", "localhost:5000/x/y@sha256:" + "0" * 64], "a tag"),
                        (["--push", "not a reference"], "--push")):
        result = runner.invoke(app, ["compile", str(recipe), *argv])
        assert result.exit_code == 2 and named in result.output, (argv, result.output)
    assert not (tmp_path / "o").exists()
    # a registry that is not there: a failure before the build, not after it
    down = runner.invoke(app, ["compile", str(recipe), "--cache-dir", str(tmp_path / "cache"),
                               "--push", f"127.0.0.1:{free_port()}/x/y:v1"])
    assert down.exit_code == 1 and "not reachable" in down.output, down.output
    assert not list(tmp_path.glob("cache/*/*/cache-entry.json"))


def test_a_mount_the_registry_will_not_do_is_cancelled_and_reported(registries):
    from qpcbuild.registry.client import RegistryClient, sha256_digest

    data = b"a blob only one repository has"
    digest = sha256_digest(data)
    with RegistryClient(registries[0].address) as client:
        client.push_blob("team/a", digest, len(data), data=data)
        # the registry opens an ordinary upload instead (the blob is not in team/none)
        assert client.mount_blob("team/b", digest, "team/none") is False
        assert not client.has_blob("team/b", digest)
        assert client.mount_blob("team/b", digest, "team/a") is True
        assert client.read_blob("team/b", digest) == data

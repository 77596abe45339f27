"""The registry as the build cache's shared tier (`compile --remote-cache`), against a real
registry: a second runner with an empty local cache builds from hits, the tags record their
keys' inputs, racing builders both finish, and a registry that stops, refuses or holds damaged
bytes costs a warning and a local build (or a clear failure when the tier is required)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import onnx
import pytest
from typer.testing import CliRunner

from qpcbuild.bundle import build_bundle, read_manifest, verify_bundle
from qpcbuild.cli import app
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe
from qpcbuild.registry.remote_cache import RemoteCache
from helpers_registry import compile_json, demo_checkout, origins
from qpcbuild.testing import free_port
from registry_server import start_registry

pytestmark = pytest.mark.slow
QPCBUILD = [sys.executable, "-m", "qpcbuild"]
runner = CliRunner()


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return demo_checkout(tmp_path_factory.mktemp("checkout"))


@pytest.fixture
def registry(tmp_path):
    server = start_registry(tmp_path / "registry")
    yield server
    server.stop()


def test_a_second_runner_builds_from_hits_and_tags_record_the_key_inputs(recipe, registry,
                                                                         tmp_path):
    remote = f"{registry.address}/ci/cache"
    first, _ = compile_json(recipe, tmp_path / "a", tmp_path / "cache-a", "--remote-cache",
                            remote)
    assert set(origins(first).values()) == {"built"}
    second, _ = compile_json(recipe, tmp_path / "b", tmp_path / "cache-b", "--remote-cache",
                             remote)
    assert set(origins(second).values()) == {"remote"}
    assert all(s["reused"] for s in second["stages"])
    assert second["bundle_id"] == first["bundle_id"] and verify_bundle(tmp_path / "b") == []
    # Both ONNX Runtime artifacts were hits, so the graphs they were made from stayed remote.
    entries = sorted(tmp_path.glob("cache-b/*/*/cache-entry.json"))
    assert [p.parent.parent.name for p in entries] == ["ort", "ort"]
    # The pulled artifacts landed in runner B's local cache: the next build there uses them
    # (and again only the graphs' records from the registry).
    third, _ = compile_json(recipe, tmp_path / "c", tmp_path / "cache-b", "--remote-cache",
                            remote)
    assert origins(third) == {"export target": "remote", "export draft": "remote",
                              "onnxruntime target": "local", "onnxruntime draft": "local"}
    # One tag per key; its annotations say what the key was made of.
    tags = httpx.get(f"http://{registry.address}/v2/ci/cache/tags/list").json()["tags"]
    assert len(tags) == 4 and sorted(t.split("-")[0] for t in tags) == ["exports", "exports",
                                                                         "ort", "ort"]
    export_tag = next(t for t in tags if t.startswith("exports-"))
    m = httpx.get(f"http://{registry.address}/v2/ci/cache/manifests/{export_tag}",
                  headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    a = m["annotations"]
    assert a["vnd.qpcbuild.cache.key"] == export_tag.split("-", 1)[1]
    assert a["vnd.qpcbuild.cache.input.onnx"] == onnx.__version__
    assert len(a["vnd.qpcbuild.cache.input.weights"]) == 64


def test_an_existing_local_cache_seeds_the_registry(recipe, registry, tmp_path):
    remote = f"{registry.address}/ci/cache"
    compile_json(recipe, tmp_path / "a", tmp_path / "cache-a")  # before the registry was used
    seeding, _ = compile_json(recipe, tmp_path / "b", tmp_path / "cache-a", "--remote-cache",
                              remote)
    assert set(origins(seeding).values()) == {"local"}
    fresh, _ = compile_json(recipe, tmp_path / "c", tmp_path / "cache-c", "--remote-cache",
                            remote)
    assert set(origins(fresh).values()) == {"remote"}
    # the graphs were shared too, though the seeding build did not need to open them
    tags = httpx.get(f"http://{registry.address}/v2/ci/cache/tags/list").json()["tags"]
    assert sorted(t.split("-")[0] for t in tags) == ["exports", "exports", "ort", "ort"]


def test_the_environment_variable_turns_the_remote_tier_on(recipe, registry, tmp_path):
    env = {"QPCBUILD_REMOTE_CACHE": f"{registry.address}/ci/cache"}
    runner.invoke(app, ["compile", str(recipe), "-o", str(tmp_path / "a"), "--cache-dir",
                        str(tmp_path / "cache-a")], env=env)
    result = runner.invoke(app, ["compile", str(recipe), "-o", str(tmp_path / "b"),
                                 "--cache-dir", str(tmp_path / "cache-b"), "--json"], env=env)
    assert set(origins(json.loads(result.stdout)).values()) == {"remote"}


def test_two_builders_racing_on_one_key_both_finish(recipe, registry, tmp_path):
    procs = [subprocess.Popen([*QPCBUILD, "compile", str(recipe), "-o", str(tmp_path / f"out{n}"),
                               "--remote-cache", f"{registry.address}/ci/cache", "--json"],
                              env={**os.environ, "QPCBUILD_CACHE": str(tmp_path / f"cache{n}")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert results[0]["bundle_id"] == results[1]["bundle_id"]
    for n in range(2):
        assert verify_bundle(tmp_path / f"out{n}") == []
    # Whoever pushed last, the tags hold complete entries: a third runner builds from them.
    third, _ = compile_json(recipe, tmp_path / "c", tmp_path / "cache-c", "--remote-cache",
                            f"{registry.address}/ci/cache")
    assert set(origins(third).values()) == {"remote"}
    assert third["bundle_id"] == results[0]["bundle_id"]


def test_the_registry_stopping_mid_build_falls_back_to_a_local_build(recipe, registry,
                                                                      tmp_path):
    plain, _ = compile_json(recipe, tmp_path / "plain", tmp_path / "cache-plain")
    warnings: list[str] = []
    cache = RemoteCache(tmp_path / "cache", f"{registry.address}/ci/cache", say=warnings.append)
    seen: list[str] = []

    def progress(stage: str, how: str, seconds: float) -> None:
        seen.append(stage)
        if len(seen) == 1:
            registry.stop()  # after the first artifact was looked up, built and pushed

    result = build_bundle(make_plan(load_recipe(recipe)), cache=cache, out=tmp_path / "out",
                          progress=progress)
    assert result.bundle_id == plain["bundle_id"] and verify_bundle(tmp_path / "out") == []
    assert [s["from"] for s in result.stages] == ["built"] * 4
    assert len(warnings) == 1 and "not used for the rest of this build" in warnings[0]
    assert "not reachable" in warnings[0]


def test_a_down_registry_is_a_warning_unless_required(recipe, tmp_path):
    remote = f"127.0.0.1:{free_port()}/ci/cache"
    result, stderr = compile_json(recipe, tmp_path / "a", tmp_path / "cache", "--remote-cache",
                                  remote)
    assert "warning" in stderr and "not reachable" in stderr
    assert set(origins(result).values()) == {"built"}
    failed = runner.invoke(app, ["compile", str(recipe), "-o", str(tmp_path / "b"),
                                 "--cache-dir", str(tmp_path / "cache2"), "--remote-cache",
                                 remote, "--remote-cache-required"])
    assert failed.exit_code == 1 and "--remote-cache-required" in failed.output
    assert "Traceback" not in failed.output and not (tmp_path / "b").exists()


def test_a_damaged_remote_entry_is_rebuilt_locally(recipe, registry, tmp_path):
    remote = f"{registry.address}/ci/cache"
    first, _ = compile_json(recipe, tmp_path / "a", tmp_path / "cache-a", "--remote-cache",
                            remote)
    # Flip a byte of the target's ONNX Runtime weights where the registry stores them.
    digest = read_manifest(tmp_path / "a").file_list()["target/ort/model.onnx.data"]["sha256"]
    blob = registry.blob_path(digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    second, stderr = compile_json(recipe, tmp_path / "b", tmp_path / "cache-b",
                                  "--remote-cache", remote)
    assert "unusable" in stderr and "digest" in stderr
    # the target's graph was fetched after all, to rebuild its ONNX Runtime artifact
    assert origins(second) == {"export target": "remote", "export draft": "remote",
                               "onnxruntime target": "built", "onnxruntime draft": "remote"}
    assert (tmp_path / "cache-b" / "exports").is_dir()
    assert second["bundle_id"] == first["bundle_id"] and verify_bundle(tmp_path / "b") == []


def test_contradicting_flags_are_refused(recipe, tmp_path):
    for argv, named in ((["--no-cache", "--remote-cache", "localhost:5000/x/y"], "--no-cache"),
                        (["--remote-cache-required"], "--remote-cache"),
                        (["--remote-cache", "localhost:5000/x/y:tag"], "without a tag"),
                        (["--unit", "export-target", "--emit-only"], "--unit")):
        result = runner.invoke(app, ["compile", str(recipe), "-o", str(tmp_path / "o"), *argv])
        assert result.exit_code == 2 and named in result.output, (argv, result.output)

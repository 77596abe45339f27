"""What makes a build from the remote cache and a pull fast, without giving up a check: the
bundle is sealed from the digests its cache entries recorded (files changed since delivery are
hashed after all), downloads write in a second thread, and the small layers move beside the
largest one."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

import qpcbuild.bundle.build as build_mod
from qpcbuild.cache import META, Cache
from qpcbuild.delivered import DeliveredFiles
from qpcbuild.cli import app
from qpcbuild.registry.artifact import _largest_beside_rest
from qpcbuild.registry.writer import BackgroundWriter
from qpcbuild.tree import hash_tree
from registry_server import start_registry

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _entry(tmp_path: Path) -> tuple[Cache, Path]:
    def build(tmp: Path) -> dict:
        (tmp / "onnx").mkdir()
        (tmp / "onnx" / "model.onnx").write_bytes(b"graph" * 1000)
        (tmp / "onnx" / "model.onnx.data").write_bytes(os.urandom(300_000))
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        (tmp / "run.sh").chmod(0o755)
        return {}

    cache = Cache(tmp_path / "cache")
    entry, _, reused = cache.get_or_build("exports", "k" * 64, build)
    assert not reused
    return cache, entry


def test_delivered_files_carry_the_digests_hashing_gives(tmp_path):
    cache, entry = _entry(tmp_path)
    bundle = tmp_path / "bundle"
    known = DeliveredFiles(bundle)
    cache.deliver(entry, bundle, skip=(META,), known=known)
    cache.deliver(entry / "onnx", bundle / "target" / "onnx", known=known)  # a folder of it
    # the oracle: hashing the delivered files afresh
    assert known.unchanged() == hash_tree(bundle)
    assert known.unchanged()["run.sh"]["executable"] is True


def test_a_delivered_file_written_over_is_hashed_again(tmp_path):
    cache, entry = _entry(tmp_path)
    bundle = tmp_path / "bundle"
    known = DeliveredFiles(bundle)
    cache.deliver(entry, bundle, skip=(META,), known=known)
    data = bundle / "onnx" / "model.onnx.data"
    data.write_bytes(os.urandom(300_000))  # same size, other bytes
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # whatever the clock's resolution
    assert "onnx/model.onnx.data" not in known.unchanged()
    assert set(known.unchanged()) == {"onnx/model.onnx", "run.sh"}


def test_a_file_outside_the_cache_gets_no_recorded_digest(tmp_path):
    cache, _ = _entry(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "f").write_bytes(b"x")
    known = DeliveredFiles(tmp_path / "bundle")
    cache.deliver(elsewhere, tmp_path / "bundle", known=known)
    assert known.unchanged() == {}


@pytest.mark.slow
def test_a_build_from_the_remote_cache_reads_only_what_it_made(tmp_path, monkeypatch):
    """Runner B (empty cache) builds the demo from the registry: the seal hashes only the
    tokenizer and recipe it wrote, and the bundle id is runner A's (a cold build's)."""
    registry = start_registry(tmp_path / "registry")
    try:
        shutil.copytree(REPO / "models" / "demo", tmp_path / "models" / "demo")
        shutil.copytree(REPO / "recipes", tmp_path / "recipes")
        recipe = str(tmp_path / "recipes" / "demo.yaml")
        remote = f"{registry.address}/team/cache"

        def compile_(name: str) -> dict:
            result = runner.invoke(app, ["compile", recipe, "-o", str(tmp_path / name),
                                         "--cache-dir", str(tmp_path / f"cache-{name}"),
                                         "--remote-cache", remote, "--json"])
            assert result.exit_code == 0, result.output
            return json.loads(result.stdout)

        cold = compile_("a")
        hashed: list[str] = []
        real = build_mod.hash_tree

        def recording(root, *args, **kwargs):
            found = real(root, *args, **kwargs)
            hashed.extend(found)
            return found

        monkeypatch.setattr(build_mod, "hash_tree", recording)
        warm = compile_("b")
    finally:
        registry.stop()
    assert {s["from"] for s in warm["stages"]} == {"remote"}
    assert warm["bundle_id"] == cold["bundle_id"]
    assert hashed and all(p.startswith("tokenizer/") or p == "recipe.yaml" for p in hashed)


class _FailingFile:
    def __init__(self):
        self.writes = 0

    def write(self, data) -> None:
        self.writes += 1
        raise OSError(28, "No space left on device")


def test_a_write_error_in_the_writer_thread_reaches_the_caller():
    with BackgroundWriter(_FailingFile(), pieces=2, size=16) as writer:
        buf = writer.buffer()
        buf[:4] = b"abcd"
        writer.write(buf[:4])
        with pytest.raises(OSError, match="No space"):
            writer.flush()
        with pytest.raises(OSError):  # and on every later call
            writer.buffer()


def test_a_buffer_lent_for_a_read_that_broke_off_is_lent_again(tmp_path):
    """One buffer, lent three times without a write (three broken reads): no deadlock."""
    with open(tmp_path / "f", "wb") as out, BackgroundWriter(out, pieces=1, size=8) as w:
        first = w.buffer()
        assert w.buffer() is first and w.buffer() is first
        first[:3] = b"xyz"
        w.write(first[:3])
        w.buffer()[:2] = b"!!"  # handed out again once written
        w.write(w.buffer()[:2])
        w.flush()
    assert (tmp_path / "f").read_bytes() == b"xyz!!"


def test_the_largest_transfer_runs_in_the_calling_thread_and_failures_surface():
    files = {"small": {"size": 1}, "big": {"size": 100}, "mid": {"size": 10}}
    threads = {}

    def transfer(rel, meta):
        threads[rel] = threading.current_thread() is threading.main_thread()
        return meta["size"] * 2

    assert _largest_beside_rest(files, transfer) == {"big": 200, "mid": 20, "small": 2}
    assert threads == {"big": True, "mid": False, "small": False}

    def failing(rel, meta):
        if rel == "small":
            raise RuntimeError("small failed")
        return 0

    with pytest.raises(RuntimeError, match="small failed"):
        _largest_beside_rest(files, failing)

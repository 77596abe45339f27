"""A damaged export entry in the build cache is found, said and repaired by the next `compile`,
even when that build needs only the entry's record (an ONNX Runtime bundle whose runtime
artifact is cached): otherwise it was reported as reused and stayed damaged for the next build
that needs the graph."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.bundle import verify_bundle
from qpcbuild.cli import app

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "demo-ngram.yaml"
pytestmark = pytest.mark.slow
runner = CliRunner()


def compile_into(out: Path, cache: Path):
    result = runner.invoke(app, ["compile", str(RECIPE), "-o", str(out), "--cache-dir",
                                 str(cache)])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("warm")
    compile_into(root / "bundle", root / "cache")
    return root / "cache"


def writable(path: Path) -> Path:
    path.chmod(0o644)
    return path


def flip(e: Path):
    data = bytearray(writable(e / "onnx" / "model.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0x10
    (e / "onnx" / "model.onnx.data").write_bytes(bytes(data))


def truncate(e: Path):
    with open(writable(e / "onnx" / "model.onnx.data"), "r+b") as fh:
        fh.truncate(100)


def empty(e: Path):
    writable(e / "onnx" / "model.onnx").write_bytes(b"")


def delete(e: Path):
    (e / "onnx" / "model.onnx.data").unlink()


def symlink(e: Path):
    graph = e / "onnx" / "model.onnx"
    shutil.copy(graph, e.parents[1].parent / "elsewhere.onnx")
    graph.unlink()
    graph.symlink_to(e.parents[1].parent / "elsewhere.onnx")


def fifo(e: Path):
    (e / "onnx" / "model.onnx").unlink()
    os.mkfifo(e / "onnx" / "model.onnx")


def extra(e: Path):
    (e / "onnx" / "notes.txt").write_text("not part of the entry\n")


def entry_is_a_link(e: Path):
    shutil.copytree(e, e.parents[1].parent / "moved", symlinks=True)
    shutil.rmtree(e)
    e.symlink_to(e.parents[1].parent / "moved")


@pytest.mark.parametrize("damage", [flip, truncate, empty, delete, symlink, fifo, extra,
                                    entry_is_a_link])
def test_compile_says_it_rebuilt_a_damaged_export_entry_and_repairs_it(warm_cache, tmp_path,
                                                                       damage):
    cache = Path(shutil.copytree(warm_cache, tmp_path / "cache", symlinks=True))
    (entry,) = (cache / "exports").iterdir()
    damage(entry)
    damaged = runner.invoke(app, ["cache", "verify", "--cache-dir", str(cache)])
    assert damaged.exit_code != 0 and f"exports/{entry.name}" in damaged.output

    result = compile_into(tmp_path / "bundle", cache)
    assert f"cache entry exports/{entry.name} is damaged" in result.output and \
        "rebuilding it" in result.output, result.output
    assert "export target                built" in result.output
    assert verify_bundle(tmp_path / "bundle") == []
    repaired = runner.invoke(app, ["cache", "verify", "--cache-dir", str(cache)])
    assert repaired.exit_code == 0 and "0 damaged" in repaired.output, repaired.output
    assert not entry.is_symlink()

    again = compile_into(tmp_path / "again", cache)  # repaired: reused, nothing said
    assert "damaged" not in again.output and "export target                reused" in \
        again.output, again.output

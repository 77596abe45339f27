"""benchmarks/peers/get_peers.py: the checks that guard the peers' set-up, without building anything
(the llama.cpp build and the conversions are measured in docs/qwen-coder.md, not in CI)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from benchmarks.peers import get_peers
from benchmarks.peers.get_peers import PeerError


def _tarball(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


def test_a_source_tarball_unpacks_into_its_one_folder(tmp_path):
    archive = _tarball(tmp_path / "src.tar.gz", {"pkg-1.0/vendor/llama.cpp/CMakeLists.txt": b"x",
                                                 "pkg-1.0/README": b"r"})
    out = tmp_path / "out"
    out.mkdir()
    top = get_peers.extract_safely(archive, out)
    assert top == out / "pkg-1.0"
    assert (top / "vendor" / "llama.cpp" / "CMakeLists.txt").read_bytes() == b"x"


@pytest.mark.parametrize("members, links", [({"../escaped.txt": b"2"}, None),
                                            ({}, {"pkg-1.0/passwd": "/etc/passwd"}),
                                            ({}, {"pkg-1.0/up": "../../escaped.txt"})])
def test_a_member_reaching_outside_the_folder_is_refused(tmp_path, members, links):
    archive = _tarball(tmp_path / "src.tar.gz", {"pkg-1.0/ok": b"1", **members}, links)
    out = tmp_path / "deep" / "out"
    out.mkdir(parents=True)
    with pytest.raises(PeerError) as err:
        get_peers.extract_safely(archive, out)
    assert err.value.code == 2 and "unsafe member" in str(err.value)
    assert not (tmp_path / "deep" / "escaped.txt").exists()
    assert not (out / "pkg-1.0" / "passwd").exists()


def test_an_sdist_with_the_wrong_digest_is_refused_and_removed(tmp_path, monkeypatch):
    name, version, _ = get_peers.LLAMA_CPP_SDIST
    cached = tmp_path / f"{name.replace('-', '_')}-{version}.tar.gz"
    cached.write_bytes(b"not the pinned sdist")
    with pytest.raises(PeerError) as err:
        get_peers.obtain_sdist(tmp_path)
    assert err.value.code == 2 and "pinned" in str(err.value)
    assert not cached.exists()  # the next run downloads it again rather than trusting it


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "conversion.json").write_text(json.dumps(
        {"files": {"model.safetensors": "ab" * 32, "config.json": "cd" * 32}}))
    return folder


def test_a_gguf_this_script_did_not_write_is_never_replaced(tmp_path):
    folder = _model_folder(tmp_path)
    theirs = folder / "their-q5.gguf"
    theirs.write_bytes(b"GGUF theirs")
    with pytest.raises(PeerError) as err:
        get_peers.write_gguf(folder, "q4_0", tmp_path, tmp_path, "")
    assert err.value.code == 2 and "their-q5.gguf" in str(err.value)
    assert theirs.read_bytes() == b"GGUF theirs"


def test_a_gguf_already_written_from_the_same_weights_is_kept(tmp_path, monkeypatch):
    folder = _model_folder(tmp_path)
    ours = folder / "model-q4_0.gguf"
    ours.write_bytes(b"GGUF ours")
    (folder / get_peers.RECORD).write_text(json.dumps(
        {"gguf": ours.name, "type": "q4_0", "safetensors": {"model.safetensors": "ab" * 32},
         "llama_cpp": list(get_peers.LLAMA_CPP_SDIST[:2])}))
    ran = []
    monkeypatch.setattr(get_peers, "_run", lambda cmd, what, **kw: ran.append(what))
    assert get_peers.write_gguf(folder, "q4_0", tmp_path, tmp_path, "") == ours
    assert ran == [] and ours.read_bytes() == b"GGUF ours"
    # Other weights (a new conversion) make it stale: the converter runs again.
    (folder / "conversion.json").write_text(json.dumps({"files": {"model.safetensors": "ef" * 32}}))
    with pytest.raises(FileNotFoundError):  # the stubbed converter wrote nothing to rename
        get_peers.write_gguf(folder, "q4_0", tmp_path, tmp_path, "")
    assert ran[0].startswith("converting") and ran[1].startswith("quantizing")
    assert ours.read_bytes() == b"GGUF ours"  # a failed run leaves the old file in place


def _stub_tools(monkeypatch) -> list[str]:
    """The converter and llama-quantize replaced by stand-ins that write their output file (its
    text says how it was made), so the bookkeeping around them runs for real."""
    ran: list[str] = []

    def run(cmd, what, **kw):
        ran.append(what)
        if what.startswith("converting"):
            Path(cmd[cmd.index("--outfile") + 1]).write_text("f32")
        else:
            Path(cmd[2]).write_text(f"{cmd[3]} of {Path(cmd[1]).read_text()}")
    monkeypatch.setattr(get_peers, "_run", run)
    return ran


def test_the_target_is_written_at_each_precision_from_one_conversion(tmp_path, monkeypatch):
    folder = _model_folder(tmp_path)
    ran = _stub_tools(monkeypatch)
    paths = get_peers.write_ggufs(folder, ["f32", "q4_0", "q4_k_m"], tmp_path, tmp_path, "")
    assert [p.name for p in paths] == ["model-f32.gguf", "model-q4_0.gguf", "model-q4_k_m.gguf"]
    assert [p.read_text() for p in paths] == ["f32", "Q4_0 of f32", "Q4_K_M of f32"]
    assert ran == ["converting model to GGUF", "quantizing model to q4_0",
                   "quantizing model to q4_k_m"]
    record = json.loads((folder / get_peers.RECORD).read_text())["ggufs"]
    assert sorted(record) == ["model-f32.gguf", "model-q4_0.gguf", "model-q4_k_m.gguf"]
    assert record["model-q4_k_m.gguf"]["type"] == "q4_k_m"
    # Again: nothing to do. One precision fewer: ours of it is removed, the others kept.
    ran.clear()
    get_peers.write_ggufs(folder, ["f32", "q4_0", "q4_k_m"], tmp_path, tmp_path, "")
    assert ran == []
    get_peers.write_ggufs(folder, ["f32", "q4_0"], tmp_path, tmp_path, "")
    assert ran == [] and sorted(p.name for p in folder.glob("*.gguf")) == \
        ["model-f32.gguf", "model-q4_0.gguf"]
    # A precision added later: one conversion and one quantization, the rest untouched.
    get_peers.write_ggufs(folder, ["f32", "q4_0", "q8_0"], tmp_path, tmp_path, "")
    assert ran == ["converting model to GGUF", "quantizing model to q8_0"]
    assert not list(folder.glob(".peer-gguf-*"))  # the staging folder is gone


def test_target_types_must_be_known_and_include_f32(tmp_path, capsys):
    for bad in ("f32,q3_k", "q4_0"):
        assert get_peers.main(["gguf", "--store", str(tmp_path), "--target-types", bad]) == 2
        assert "--target-types" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was fetched or built


def test_a_committed_folder_without_conversion_record_is_stamped_by_its_weights(
        tmp_path, monkeypatch):
    """models/smollm2-draft is committed, not converted: its safetensors are hashed here, so a
    retrained draft (other weights) makes its GGUF stale."""
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights v1")
    ran = _stub_tools(monkeypatch)
    get_peers.write_gguf(folder, "q4_0", tmp_path, tmp_path, "")
    stamp = json.loads((folder / get_peers.RECORD).read_text())["ggufs"]["model-q4_0.gguf"]
    assert stamp["safetensors"] == {"model.safetensors": get_peers.sha256(
        folder / "model.safetensors")}
    ran.clear()
    (folder / "model.safetensors").write_bytes(b"weights v2")
    get_peers.write_gguf(folder, "q4_0", tmp_path, tmp_path, "")
    assert ran[0].startswith("converting")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PeerError, match="no safetensors"):
        get_peers.write_gguf(empty, "q4_0", tmp_path, tmp_path, "")

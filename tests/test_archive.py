"""Behaviour of bundle hashing, reproducible packing and hostile-archive unpacking."""

from __future__ import annotations

import errno
import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from qpcbuild.bundle import archive
from qpcbuild.bundle.archive import ArchiveError, pack, unpack
from qpcbuild.tree import file_digest, hash_tree
from qpcbuild.errors import UsageError


def make_bundle(root: Path, name: str = "bundle") -> Path:
    bundle = root / name
    (bundle / "onnx" / "sub").mkdir(parents=True)
    (bundle / "manifest.json").write_text('{"format": 1}\n')
    (bundle / "onnx" / "model.onnx").write_bytes(os.urandom(3000))
    (bundle / "onnx" / "sub" / "weights.bin").write_bytes(b"\x00" * 70_000)
    (bundle / "onnx-extra.txt").write_text("sorts between 'onnx' and 'onnx/...'\n")
    (bundle / "empty").mkdir()
    return bundle


Member = tuple[tarfile.TarInfo, bytes]


def info(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **attrs: object) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.size = len(data) if kind == tarfile.REGTYPE else 0
    for key, value in attrs.items():
        setattr(ti, key, value)
    return ti, data


def write_tar_gz(path: Path, members: list[Member]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return path


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


# --- hashing ---------------------------------------------------------------------------------


def test_file_digest_matches_known_sha256(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    assert file_digest(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_hash_tree_lists_files_sorted_with_size_and_excludes(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    tree = hash_tree(bundle, exclude=["manifest.json"])
    assert list(tree) == ["onnx-extra.txt", "onnx/model.onnx", "onnx/sub/weights.bin"]
    assert tree["onnx/sub/weights.bin"] == {
        "size": 70_000,
        "sha256": file_digest(bundle / "onnx" / "sub" / "weights.bin"),
    }


def test_hash_tree_refuses_symlink_inside_tree(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    (bundle / "onnx" / "link.onnx").symlink_to(bundle / "onnx" / "model.onnx")
    with pytest.raises(ArchiveError, match="onnx/link.onnx"):
        hash_tree(bundle)


def test_hash_tree_refuses_fifo_inside_tree(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    os.mkfifo(bundle / "pipe")
    with pytest.raises(ArchiveError, match="pipe"):
        hash_tree(bundle)


# --- packing ---------------------------------------------------------------------------------


def test_pack_twice_is_byte_identical_even_after_touching_mtimes_and_modes(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    first = pack(bundle, tmp_path / "a.tar.gz").read_bytes()
    for path in bundle.rglob("*"):
        os.utime(path, (1_000_000, 2_000_000))
    (bundle / "manifest.json").chmod(0o600)
    (bundle / "onnx" / "model.onnx").chmod(0o664)
    (bundle / "onnx").chmod(0o700)
    second = pack(bundle, tmp_path / "other-name.tar.gz").read_bytes()
    assert first == second


def test_a_tar_name_packs_without_compression_and_unpacks_the_same(tmp_path: Path,
                                                                   out_dir: Path) -> None:
    bundle = make_bundle(tmp_path)
    plain = pack(bundle, tmp_path / "a.tar")
    assert plain.read_bytes() == pack(bundle, tmp_path / "b.tar").read_bytes()
    with gzip.open(pack(bundle, tmp_path / "c.tar.gz")) as gz:
        assert gz.read() == plain.read_bytes()  # the same tar stream, only not compressed
    unpacked = unpack(plain, out_dir)
    assert hash_tree(unpacked) == hash_tree(bundle)


@pytest.mark.parametrize("name", ["bundle.zip", "bundle.gz", "archive"])
def test_an_archive_name_without_a_known_ending_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ArchiveError, match=r"\.tar\.gz.*\.tar"):
        pack(make_bundle(tmp_path), tmp_path / name)
    assert not (tmp_path / name).exists()


def test_pack_keeps_only_the_exec_bit_and_unpack_restores_it(tmp_path: Path, out_dir: Path) -> None:
    bundle = make_bundle(tmp_path)
    plain = pack(bundle, tmp_path / "a.tar.gz").read_bytes()
    (bundle / "onnx" / "model.onnx").chmod(0o700)  # owner-only, but executable
    archive = pack(bundle, tmp_path / "b.tar.gz")
    assert archive.read_bytes() != plain
    with tarfile.open(archive) as tar:
        assert tar.getmember(f"{bundle.name}/onnx/model.onnx").mode == 0o755
    unpacked = unpack(archive, out_dir)
    assert (unpacked / "onnx" / "model.onnx").stat().st_mode & 0o777 == 0o755
    assert (unpacked / "manifest.json").stat().st_mode & 0o777 == 0o644


def test_pack_normalises_headers_and_orders_entries(tmp_path: Path) -> None:
    out = pack(make_bundle(tmp_path, "my-bundle"), tmp_path / "b.tar.gz")
    raw = out.read_bytes()
    assert raw[4:8] == b"\x00\x00\x00\x00"  # gzip mtime
    assert not raw[3] & 0x08  # no FNAME flag: the temp file name must not leak
    with tarfile.open(out) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names) and names[0] == "my-bundle"
    assert "my-bundle/empty" in names
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
        assert m.mode == (0o755 if m.isdir() else 0o644)


def test_pack_missing_source_raises_and_leaves_nothing(tmp_path: Path, out_dir: Path) -> None:
    with pytest.raises(ArchiveError):
        pack(tmp_path / "absent", out_dir / "x.tar.gz")
    assert list(out_dir.iterdir()) == []


def test_pack_failure_midway_leaves_no_temp_and_keeps_old_archive(
    tmp_path: Path, out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = make_bundle(tmp_path)
    target = out_dir / "x.tar.gz"
    target.write_bytes(b"previous archive")
    real_add = archive._add_entry
    calls = []

    def failing_add(*args: object) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        real_add(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(archive, "_add_entry", failing_add)
    with pytest.raises(ArchiveError, match="disk full"):
        pack(bundle, target)
    assert list(out_dir.iterdir()) == [target]
    assert target.read_bytes() == b"previous archive"


def test_pack_refuses_output_inside_bundle(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    with pytest.raises(ArchiveError, match="inside"):
        pack(bundle, bundle / "self.tar.gz")


# --- unpacking -------------------------------------------------------------------------------


def test_pack_unpack_round_trip_preserves_hash_tree(tmp_path: Path, out_dir: Path) -> None:
    bundle = make_bundle(tmp_path)
    packed = pack(bundle, tmp_path / "b.tar.gz")
    extracted = unpack(packed, out_dir / "dest")
    assert extracted == out_dir / "dest" / "bundle"
    assert hash_tree(extracted) == hash_tree(bundle)
    assert (extracted / "empty").is_dir()
    assert [p.name for p in out_dir.iterdir()] == ["dest"]  # no staging dir left


def test_unpack_into_existing_empty_dir(tmp_path: Path, out_dir: Path) -> None:
    packed = pack(make_bundle(tmp_path), tmp_path / "b.tar.gz")
    extracted = unpack(packed, out_dir)
    assert [p.name for p in out_dir.iterdir()] == ["bundle"]
    assert hash_tree(extracted) == hash_tree(tmp_path / "bundle")


def test_unpack_creates_the_bundle_folder_beside_other_files(tmp_path: Path,
                                                             out_dir: Path) -> None:
    """As `tar -C dest` does: the archive may sit in dest itself; only dest/<bundle> is refused."""
    packed = pack(make_bundle(tmp_path), out_dir / "b.tar.gz")
    (out_dir / "keep").write_text("x")
    extracted = unpack(packed, out_dir)
    assert extracted == out_dir / "bundle"
    assert sorted(p.name for p in out_dir.iterdir()) == ["b.tar.gz", "bundle", "keep"]
    assert hash_tree(extracted) == hash_tree(tmp_path / "bundle")
    before = hash_tree(extracted)
    with pytest.raises(ArchiveError, match="bundle: exists"):
        unpack(packed, out_dir)
    assert sorted(p.name for p in out_dir.iterdir()) == ["b.tar.gz", "bundle", "keep"]
    assert hash_tree(extracted) == before  # the existing folder is untouched


def test_pack_names_the_top_folder_as_asked(tmp_path: Path, out_dir: Path) -> None:
    bundle = make_bundle(tmp_path)
    a = pack(bundle, tmp_path / "a.tar", top="my-bundle")
    renamed = bundle.rename(tmp_path / "elsewhere")
    b = pack(renamed, tmp_path / "b.tar", top="my-bundle")
    assert a.read_bytes() == b.read_bytes()
    assert unpack(a, out_dir) == out_dir / "my-bundle"
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(ArchiveError, match="top folder"):
            pack(renamed, tmp_path / "c.tar", top=bad)


GOOD = [info("b", tarfile.DIRTYPE), info("b/ok.bin", data=b"fine")]

HOSTILE = {
    "absolute": (GOOD + [info("/etc/evil", data=b"x")], "/etc/evil", "absolute"),
    "dotdot": (GOOD + [info("b/../../escape", data=b"x")], "b/../../escape", r"'\.\.'"),
    "symlink": (GOOD + [info("b/ln", tarfile.SYMTYPE, linkname="/etc/passwd")], "b/ln", "symbolic"),
    "hardlink": (GOOD + [info("b/hl", tarfile.LNKTYPE, linkname="b/ok.bin")], "b/hl", "hard link"),
    "chardev": (GOOD + [info("b/tty", tarfile.CHRTYPE, devmajor=5, devminor=0)], "b/tty", "device"),
    "fifo": (GOOD + [info("b/pipe", tarfile.FIFOTYPE)], "b/pipe", "fifo"),
    "two_tops": (GOOD + [info("c", tarfile.DIRTYPE)], "c", "top-level"),
    "top_file": ([info("lonely.txt", data=b"x")], "lonely.txt", "folder"),
    "oversize": (GOOD + [info("b/big.bin", data=b"y" * 200)], "b/big.bin", "beyond 100 bytes"),
    "duplicate": (GOOD + [info("b/ok.bin", data=b"again")], "b/ok.bin", "clashes"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_unpack_refuses_hostile_member_and_leaves_nothing(
    case: str, tmp_path: Path, out_dir: Path
) -> None:
    members, bad_name, reason = HOSTILE[case]
    bad = write_tar_gz(tmp_path / "in" / f"{case}.tar.gz", members)
    dest = out_dir / "dest"
    with pytest.raises(ArchiveError, match=reason) as caught:
        unpack(bad, dest, max_bytes=100)
    assert bad_name in str(caught.value)
    assert not dest.exists()
    assert list(out_dir.iterdir()) == []  # no staging directory left either
    assert not (tmp_path / "escape").exists()


def test_unpack_refusal_keeps_existing_empty_dest_empty(tmp_path: Path, out_dir: Path) -> None:
    bad = write_tar_gz(tmp_path / "in" / "x.tar.gz", GOOD + [info("b/../x", data=b"x")])
    with pytest.raises(ArchiveError, match=r"b/\.\./x"):
        unpack(bad, out_dir)
    assert list(out_dir.iterdir()) == []


def test_unpack_caps_member_count(tmp_path: Path, out_dir: Path) -> None:
    members = GOOD + [info(f"b/f{i}", data=b"") for i in range(5)]
    bomb = write_tar_gz(tmp_path / "in" / "many.tar.gz", members)
    with pytest.raises(ArchiveError, match="b/f1: archive has more than 3 members"):
        unpack(bomb, out_dir / "dest", max_members=3)
    assert list(out_dir.iterdir()) == []


def test_unpack_reports_corrupt_and_missing_archives(tmp_path: Path, out_dir: Path) -> None:
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not gzip at all" * 10)
    with pytest.raises(ArchiveError, match="corrupt"):
        unpack(junk, out_dir / "dest")
    truncated = tmp_path / "cut.tar.gz"
    whole = pack(make_bundle(tmp_path), tmp_path / "whole.tar.gz").read_bytes()
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ArchiveError, match="corrupt"):
        unpack(truncated, out_dir / "dest")
    with pytest.raises(ArchiveError, match="not found"):
        unpack(tmp_path / "absent.tar.gz", out_dir / "dest")
    assert list(out_dir.iterdir()) == []


def test_unpack_accepts_dot_slash_prefixed_names(tmp_path: Path, out_dir: Path) -> None:
    members = [info("./b/", tarfile.DIRTYPE), info("./b/x.txt", data=b"hello")]
    extracted = unpack(write_tar_gz(tmp_path / "in" / "dot.tar.gz", members), out_dir / "d")
    assert (extracted / "x.txt").read_bytes() == b"hello"


def test_archive_error_is_a_usage_error_with_exit_code_2() -> None:
    assert issubclass(ArchiveError, UsageError) and ArchiveError.exit_code == 2


# --- copying ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["copies", "refuses", "disk-full"])
def test_copy_file_uses_the_kernel_falls_back_when_refused_and_stops_on_a_real_error(
        tmp_path: Path, monkeypatch, kernel: str) -> None:
    from qpcbuild.tree import copy_file

    src = tmp_path / "src"
    src.write_bytes(os.urandom(3 << 20) + b"tail")
    real, calls = os.copy_file_range, []

    def kernel_copy(*args):
        calls.append(args)
        if kernel == "copies":
            return real(*args)
        code = errno.EXDEV if kernel == "refuses" else errno.ENOSPC
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "copy_file_range", kernel_copy)
    if kernel == "disk-full":
        with pytest.raises(OSError, match="No space"):
            copy_file(src, tmp_path / "dst")
        assert len(calls) == 1
        return
    copy_file(src, tmp_path / "dst")
    assert calls and (tmp_path / "dst").read_bytes() == src.read_bytes()

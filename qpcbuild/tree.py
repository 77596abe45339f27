"""Folders as data: walk, hash and copy trees of plain files (bundles and cache entries).

A bundle or cache entry must be self-contained data, so links and special files are refused
wherever a tree is read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import sys
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import UsageError

CHUNK_SIZE = 1 << 20
_FICLONE = 0x40049409  # Linux ioctl: share the source's blocks (btrfs, XFS, bcachefs)
# copy_file_range not offered by this kernel, filesystem pair or sandbox
_NO_KERNEL_COPY = {errno.ENOSYS, errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM,
                   errno.EBADF}
# Linux fallocate(2) mode: free a byte range's blocks, keeping the file's size
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class ArchiveError(UsageError):
    """A bundle folder or archive that cannot be packed or unpacked safely (exit code 2)."""


@dataclass(frozen=True)
class Entry:
    rel: str  # POSIX path relative to the tree root
    path: Path
    is_dir: bool



def _digest_and_size(path: Path, advance=None) -> tuple[str, int]:
    # Size is counted from the bytes hashed so the two can never disagree if the file changes.
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            h.update(chunk)
            size += len(chunk)
            if advance:
                advance(len(chunk))
    return h.hexdigest(), size


def file_digest(path: Path) -> str:
    """SHA-256 hex digest of a file, read in 1 MiB chunks so multi-GB files fit in memory."""
    return _digest_and_size(path)[0]


def walk(root: Path, exclude: frozenset[str] = frozenset()) -> list[Entry]:
    """Directories and regular files under root, sorted by relative path.

    Raises ArchiveError on symlinks and special files: a bundle must be self-contained data.
    """
    # The root itself may be reached through a link; only what lies inside must be plain.
    if not root.is_dir():
        raise ArchiveError(f"{root}: not a directory")
    entries: list[Entry] = []
    stack: list[tuple[Path, str]] = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        with os.scandir(folder) as it:
            for item in it:
                rel = f"{prefix}{item.name}"
                if rel in exclude:
                    continue
                if item.is_symlink():
                    raise ArchiveError(f"{rel}: symbolic links are not allowed in a bundle")
                if item.is_dir(follow_symlinks=False):
                    entries.append(Entry(rel, Path(item.path), True))
                    stack.append((Path(item.path), f"{rel}/"))
                elif item.is_file(follow_symlinks=False):
                    entries.append(Entry(rel, Path(item.path), False))
                else:
                    raise ArchiveError(f"{rel}: special files are not allowed in a bundle")
    entries.sort(key=lambda e: e.rel)
    return entries


def is_executable(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IXUSR)


def hash_tree(root: Path, exclude: Iterable[str] = (),
              what: str | None = None) -> dict[str, dict]:
    """{relative POSIX path: {"size", "sha256"[, "executable": True]}} for every regular file
    under root, sorted. `exclude` names relative paths (files or whole folders) that are
    skipped unexamined. `what` names the step in the progress display (bytes hashed)."""
    from .progress import step

    skip = frozenset(str(PurePosixPath(e)) for e in exclude)
    files = [entry for entry in walk(Path(root), skip) if not entry.is_dir]
    result: dict[str, dict] = {}
    with (step(what, sum(e.path.stat().st_size for e in files), "bytes") if what
          else nullcontext(None)) as advance:
        for entry in files:
            digest, size = _digest_and_size(entry.path, advance)
            result[entry.rel] = {"size": size, "sha256": digest}
            if is_executable(entry.path):
                result[entry.rel]["executable"] = True
    return result


def copy_file(src: Path, dst: Path) -> None:
    """An independent copy: a reflink where the filesystem offers one, else a byte copy.
    Never a hard link, so editing one copy can never change the other."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            return
        except OSError:  # not supported here (ext4, tmpfs, across filesystems)
            pass
        try:  # the kernel copies without passing the bytes through this process (2x faster)
            while os.copy_file_range(fin.fileno(), fout.fileno(), 1 << 30):
                pass
            return
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:  # a real failure (disk full): no second try
                raise
            fin.seek(0)
            fout.seek(0)
            fout.truncate()
        shutil.copyfileobj(fin, fout, CHUNK_SIZE)


def free_range(fd: int, offset: int, length: int) -> bool:
    """Give a file's blocks in [offset, offset + length) back to the filesystem; the range then
    reads as zeros and the file keeps its size. False where the system cannot (not Linux, a
    filesystem without hole punching): the bytes simply stay until the file is removed."""
    fallocate = _fallocate()
    return length > 0 and fallocate is not None and \
        fallocate(fd, _PUNCH_HOLE, offset, length) == 0


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn  # type: ignore[no-any-return]


def copy_tree(src: Path, dst: Path, skip: Iterable[str] = (), move: bool = False) -> None:
    """Copy (with `move`: rename, within one filesystem) every plain file under src into dst,
    folders created as needed; exec bits kept."""
    skipped = frozenset(skip)
    for entry in walk(Path(src)):
        if entry.rel in skipped or entry.rel.split("/")[0] in skipped:
            continue
        target = Path(dst) / entry.rel
        if entry.is_dir:
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if move:
            os.replace(entry.path, target)
            continue
        copy_file(entry.path, target)
        if is_executable(entry.path):
            target.chmod(0o755)


def lstat_state(root: Path) -> str:
    """A digest of the lstat of everything under root (what an edit, a truncation, a swap for
    a link or FIFO, or an extra file changes), or "" when root is not a folder."""
    if root.is_symlink() or not root.is_dir():
        return ""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                return ""
            h.update(f"{os.path.relpath(path, root)}\0{st.st_mode}\0{st.st_size}\0"
                     f"{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode())
    return h.hexdigest()

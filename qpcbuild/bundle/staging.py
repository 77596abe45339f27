"""Where a bundle is assembled before it exists: a locked staging folder next to the output,
renamed into place when complete, and the debris of killed builds and pulls removed. Kept
apart from build.py so that `pull` (which stages a download the same way) does not import the
exporter and the backends."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import UsageError
from .manifest import MANIFEST


def _try_lock(path: Path) -> int | None:
    """An exclusive lock on an existing file, or None when someone holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def remove_debris(out: Path) -> list[Path]:
    """Staging folders of builds into `out` that were killed (their lock is free)."""
    removed = []
    for lock in out.parent.glob(f".{out.name}.building-*.lock"):
        fd = _try_lock(lock)
        if fd is None:
            continue
        try:
            shutil.rmtree(lock.with_suffix(""), ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(lock.with_suffix(""))
        finally:
            os.close(fd)
    # A staging folder always gets its lock file first, so one without a lock is debris.
    for folder in out.parent.glob(f".{out.name}.building-*"):
        if folder.is_dir() and not folder.with_name(folder.name + ".lock").exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextmanager
def staging_folder(out: Path) -> Iterator[Path]:
    """A fresh folder next to `out`, locked for as long as this build lives; removed on any
    failure or interruption (the lock tells a later build whether it was killed)."""
    while True:
        fd_tmp, name = tempfile.mkstemp(prefix=f".{out.name}.building-", suffix=".lock",
                                        dir=out.parent)
        fcntl.flock(fd_tmp, fcntl.LOCK_EX)
        lock = Path(name)
        try:  # a concurrent cleaner may have removed the file before we locked it
            if os.stat(lock).st_ino == os.fstat(fd_tmp).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd_tmp)
    folder = lock.with_suffix("")
    try:
        folder.mkdir()
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # gone already when it was published
        lock.unlink(missing_ok=True)
        os.close(fd_tmp)


def publish(staging: Path, out: Path) -> None:
    """Move the finished bundle into place. Builds into the same output take turns here; an
    older bundle at `out` is removed only after the new one is in place."""
    lock_path = out.parent / f".{out.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for old in out.parent.glob(f".{out.name}.old-*"):  # left by a build killed right here
            shutil.rmtree(old, ignore_errors=True)
        refuse_to_replace(out)  # again: something may have appeared there since the start
        if out.exists():
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:12]}")
            os.replace(out, old)
            os.replace(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out)
    finally:
        os.close(fd)


def check_writable_parent(out: Path, option: str) -> None:
    """The folder that will hold `out` exists (created if need be) and takes new files, or a
    UsageError naming `option` and the folder: checked before any work is done, so a bad
    destination (/proc/x, /dev/null/x, a path under a file) costs nothing."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {out}: cannot create {out.parent} "
                         f"({exc.strerror or exc})") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {out}: {out.parent} is not writable")
    try:  # root passes access() everywhere; /proc and read-only mounts still refuse files
        fd, probe = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{option} {out}: cannot write files in {out.parent} "
                         f"({exc.strerror or exc})") from None


def refuse_to_replace(out: Path) -> None:
    """Only a bundle (or an empty folder) at `out` may be replaced."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"-o {out}: exists and is not a folder")
    if out.is_dir() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise UsageError(f"-o {out}: exists and is not a qpcbuild bundle; refusing to replace it")

"""Reading a small file that someone else may have put there: a key, a signature file, a
bundle manifest. Only a regular file is read (a FIFO would block forever, /dev/zero would fill
memory), and never more than a stated number of bytes."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import QpcbuildError


def read_small_file(path: Path, limit: int, error: type[QpcbuildError],
                    what: str | None = None, follow_links: bool = True) -> bytes:
    """The bytes of `path`, or `error` naming it (`what`, default the path) when it is missing,
    unreadable, not a regular file, or larger than `limit` bytes. `follow_links=False` for a
    file inside a bundle, which must hold its own data."""
    what = what or str(path)
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{what}: no such file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise error(f"{what}: a symbolic link; a bundle's files must be its own") from None
        raise error(f"{what}: cannot be read ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
        raise error(f"{what}: not a regular file ({kind})")
    with os.fdopen(fd, "rb") as fh:
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise error(f"{what}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{what}: larger than {limit:,} bytes, more than such a file ever holds")
    return data

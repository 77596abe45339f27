"""Blobs a pull need not download again: the files of the bundle already at the destination
(an earlier pull of the same or an older version) and the verified blobs an interrupted pull
kept beside it (`.NAME.partial/<sha256>`), as docker keeps the layers it has. Every file found
is hashed before it is used: only bytes that match the sealed digest stand in for a download."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..tree import copy_file, file_digest


def partial_folder(out: Path) -> Path:
    """Where an interrupted pull into `out` keeps the blobs it finished (hidden, beside it)."""
    return out.parent / f".{out.name}.partial"


class LocalBlobs:
    """Verified local copies of layers, for a pull into `out`."""

    def __init__(self, out: Path):
        self.out, self.kept = out, partial_folder(out)
        self._hashed: dict[Path, str] = {}

    def _matches(self, path: Path, meta: dict) -> bool:
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size != meta["size"]:
                return False
            if path not in self._hashed:
                self._hashed[path] = file_digest(path)
        except OSError:
            return False
        return self._hashed[path] == meta["sha256"]

    def place(self, rel: str, meta: dict, target: Path) -> str | None:
        """Put a verified local copy of the layer at `target`; where it came from, or None."""
        kept = self.kept / meta["sha256"]
        if self._matches(kept, meta):
            # A second name for the kept blob: it stays kept if this pull is interrupted too.
            os.link(kept, target)
            return "kept from an interrupted pull"
        old = self.out / rel
        if self.out.is_dir() and not self.out.is_symlink() and self._matches(old, meta):
            copy_file(old, target)  # an independent copy: `out` is live until replaced
            return f"unchanged in {self.out}"
        return None

    def keep(self, meta: dict, downloaded: Path) -> None:
        """Remember a finished, verified download, so that an interrupted pull resumes after
        it. A hard link: no bytes copied, and the partial folder goes once the pull succeeds."""
        self.kept.mkdir(exist_ok=True)
        name = self.kept / meta["sha256"]
        try:
            os.link(downloaded, name)
        except FileExistsError:
            pass
        except OSError:  # no hard links on this filesystem: the blob is simply not kept
            pass

    def discard(self) -> None:
        shutil.rmtree(self.kept, ignore_errors=True)

"""Blobs a pull need not download again: the files of the bundle already at the destination
(an earlier pull of the same or an older version) and the verified blobs an interrupted pull
kept beside it (`.NAME.partial/<sha256>`), as docker keeps the layers it has, and the first
bytes of a blob it was cut off in (`<sha256>.part`, resumed from where it stopped). Every file
found is hashed before it is used: only bytes that match the sealed digest count."""

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

    def start(self, meta: dict, target: Path) -> bool:
        """Before a download into `target`: give it a second name, `<sha256>.part` in the kept
        folder, so the bytes it receives outlive an interrupted pull (even a SIGKILLed one).
        True when such a part was there: `target` then holds the blob's first bytes, to
        resume from (the download hashes them again; a wrong prefix fails the digest)."""
        part = self.kept / f"{meta['sha256']}.part"
        try:
            self.kept.mkdir(exist_ok=True)
            if not part.is_symlink() and part.is_file() and \
                    0 < part.stat().st_size < meta["size"]:
                os.link(part, target)
                return True
            part.unlink(missing_ok=True)
            target.touch()
            os.link(target, part)
        except OSError:  # no hard links here: the download simply starts from its first byte
            pass
        return False

    def failed(self, meta: dict) -> None:
        """The download's bytes did not match the digest: its part is no prefix to resume."""
        (self.kept / f"{meta['sha256']}.part").unlink(missing_ok=True)

    def keep(self, meta: dict, downloaded: Path) -> None:
        """Remember a finished, verified download, so that an interrupted pull resumes after
        it. A hard link: no bytes copied, and the partial folder goes once the pull succeeds."""
        name = self.kept / meta["sha256"]
        try:
            os.link(downloaded, name)
        except OSError:  # there already, or no hard links here: then it is simply not kept
            pass
        (self.kept / f"{meta['sha256']}.part").unlink(missing_ok=True)

    def discard(self) -> None:
        shutil.rmtree(self.kept, ignore_errors=True)

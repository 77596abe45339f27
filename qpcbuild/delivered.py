"""What a cache puts into a bundle being sealed, with the digests its entries recorded, so the
seal reads only files nobody has hashed yet; for a bundle pushed as it is built, where each
file's bytes are instead (cache.Cache.deliver)."""

from __future__ import annotations

import os
from pathlib import Path

from .tree import is_executable


def _file_state(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


class DeliveredFiles:
    """Files a cache put into a folder being sealed, with the digests their entry recorded,
    so the seal reads only the files nobody has hashed yet. A delivered file whose size,
    modification time or inode has changed since (something wrote over it) is not among
    them: the seal hashes it."""

    def __init__(self, root: Path, by_reference: bool = False):
        self.root = Path(root)
        # compile --push: files stay where the cache has them (an entry, a registry blob)
        self.by_reference = by_reference
        self._files: dict[str, tuple[dict, tuple[int, int, int]]] = {}
        self._elsewhere: dict[str, tuple[dict, object]] = {}

    def add(self, path: Path, meta: dict) -> None:
        state = _file_state(path)
        if state is not None and state[0] == meta["size"] and \
                is_executable(path) == bool(meta.get("executable")):
            self._files[self._rel(path)] = (sealed_fields(meta), state)

    def add_elsewhere(self, path: Path, meta: dict, source: object) -> None:
        """A file of the bundle whose bytes stay at `source` (cache.source_of)."""
        self._elsewhere[self._rel(path)] = (sealed_fields(meta), source)

    def _rel(self, path: Path) -> str:
        return Path(path).relative_to(self.root).as_posix()

    def unchanged(self) -> dict[str, dict]:
        """{path: recorded size, sha256[, executable]} of the delivered files still as they
        were delivered, and of those delivered by reference: the seal takes these instead of
        reading the files again."""
        return {**{rel: meta for rel, (meta, state) in self._files.items()
                   if _file_state(self.root / rel) == state},
                **{rel: meta for rel, (meta, _) in self._elsewhere.items()
                   if not os.path.lexists(self.root / rel)}}

    def sources(self) -> dict[str, object]:
        """{path in the bundle: where its bytes are} for the files delivered by reference
        (a file written in the folder since then is read from there instead)."""
        return {rel: source for rel, (_, source) in self._elsewhere.items()
                if not os.path.lexists(self.root / rel)}


def sealed_fields(meta: dict) -> dict:
    """What a manifest records of a file: size, sha256, and `executable` only when set."""
    return {"size": meta["size"], "sha256": meta["sha256"],
            **({"executable": True} if meta.get("executable") else {})}

"""Content-addressed build cache: one folder per (kind, key), created atomically under a lock.

Keys come from the plan (a digest of everything that shapes the artifact), so changing K or the
core split reuses both exports, and a new draft reuses the target's. Two builds sharing a cache
wait for each other on the entry they both need instead of writing it twice.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock
from platformdirs import user_cache_dir

META = "cache-entry.json"


def default_cache_dir() -> Path:
    return Path(os.environ.get("QPCBUILD_CACHE") or user_cache_dir("qpcbuild"))


def _make_read_only(root: Path) -> None:
    # Bundles hard-link cache files; read-only files make an accidental edit fail loudly
    # instead of silently changing every bundle that shares them.
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


class Cache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else default_cache_dir()

    def entry(self, kind: str, key: str) -> Path:
        return self.root / kind / key

    def get_or_build(self, kind: str, key: str,
                     build: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any], bool]:
        """Return (entry folder, its metadata, reused?). `build(tmp)` fills a fresh folder."""
        final = self.entry(kind, key)
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / "locks" / f"{kind}-{key}.lock")):
            if (final / META).is_file():
                return final, json.loads((final / META).read_text()), True
            if final.exists():  # an entry without its marker was never finished
                shutil.rmtree(final)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
            try:
                meta = build(tmp)
                (tmp / META).write_text(json.dumps(meta, indent=1, default=str) + "\n")
                _make_read_only(tmp)
                os.replace(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return final, meta, False


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = (META,)) -> None:
    """Hard-link (or copy across filesystems) a cached folder into a bundle being assembled."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.name in skip:
            continue
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)

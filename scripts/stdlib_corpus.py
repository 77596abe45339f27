"""The Python standard library's own source as training text: both training scripts read it, so
the walk (which folders, which files, in which order) is written once."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path


def stdlib_sources(skipped_dirs: set[str]) -> list[tuple[str, Path]]:
    """(path relative to the stdlib root, path) of every .py file that is not a test module, in
    a sorted walk (the same order on every machine with the same Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skipped_dirs)
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return found

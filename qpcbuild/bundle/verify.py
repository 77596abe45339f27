"""Does a bundle still hold exactly what its manifest sealed? Every field, every file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import BundleError, QpcbuildError
from ..tree import hash_tree, walk
from .manifest import UNSEALED_FILES, SealedManifest


def actual_files(bundle: Path, fast: bool) -> dict[str, dict[str, Any]]:
    if not fast:
        return hash_tree(bundle, exclude=UNSEALED_FILES, what=f"hashing {bundle}")
    found = {}
    for entry in walk(bundle, frozenset(UNSEALED_FILES)):
        if not entry.is_dir:
            found[entry.rel] = {"size": entry.path.stat().st_size}
    return found


def compare_files(expected: dict[str, dict[str, Any]], actual: dict[str, dict[str, Any]],
                  fast: bool = False,
                  adopting: tuple[str, ...] = ()) -> list[str]:
    """Differences between the manifest's file list and the files found. `adopting`: folders
    whose new files are about to be added to the manifest (by `finish`), so they are not
    reported as extra."""
    problems = []
    for path, meta in sorted(expected.items()):
        got = actual.get(path)
        if got is None:
            problems.append(f"missing file: {path}")
        elif got["size"] != meta["size"]:
            problems.append(f"changed file: {path} (size {got['size']}, manifest {meta['size']})")
        elif not fast and got["sha256"] != meta["sha256"]:
            problems.append(f"changed file: {path} (sha256 differs from the manifest)")
        elif not fast and got.get("executable", False) != meta.get("executable", False):
            problems.append(f"changed file mode: {path} ("
                            + ("no longer executable)" if meta.get("executable") else
                               "now executable)"))
    for path in sorted(set(actual) - set(expected)):
        if not any(path.startswith(f"{folder}/") for folder in adopting):
            problems.append(f"extra file: {path}")
    return problems


def verify_bundle(bundle: Path, fast: bool = False) -> list[str]:
    """Problems found (empty = intact). `fast` checks presence and sizes, not digests (nor the
    seal, whose content includes the digests)."""
    bundle = Path(bundle)
    manifest = SealedManifest(bundle)
    problems = [] if fast else manifest.changed_fields()
    if not problems:  # an intact seal over values the runtime cannot use (re-sealed edits)
        try:
            manifest.checked()
        except BundleError as exc:
            problems.append(str(exc))
    try:
        actual = actual_files(bundle, fast)
    except (OSError, QpcbuildError) as exc:  # a link or special file inside the bundle
        return problems + [str(exc)]
    return problems + compare_files(manifest.files, actual, fast)

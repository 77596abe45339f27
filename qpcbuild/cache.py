"""Content-addressed build cache: one folder per (kind, key), created atomically under a lock.

Keys are digests of what shapes an artifact: the weights' content, the plan's settings for that
artifact and the versions of every tool that writes it; nothing else, so moving a model folder
or changing K reuses the exports. Each entry records the digests of its files when it is
created and is checked against them whenever it is reused: a changed entry is reported and
rebuilt, never passed on. Bundles get copies (or reflinks), never hard links, so editing a
bundle cannot reach the cache; what a bundle gets from an entry comes with the entry's checked
digests (DeliveredFiles), so sealing the bundle does not read those bytes again. Two builds
sharing a cache wait for each other on the entry they both need instead of writing it twice,
and the debris of a killed build is removed by the next build of the same entry (or by
`qpcbuild cache prune`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock, Timeout
from platformdirs import user_cache_dir

from .errors import UsageError
from .progress import step
from .delivered import DeliveredFiles
from .tree import copy_tree, file_digest, hash_tree, lstat_state

META = "cache-entry.json"
ENTRY_FORMAT = 2
KINDS = ("exports", "ort", "qpc")
SMOKE = "smoke"  # random checkpoints that earlier qpcbuild builds kept in the cache
Say = Callable[[str], None]


def _size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():  # an entry that became a link: not its target
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def default_cache_dir() -> Path:
    return Path(os.environ.get("QPCBUILD_CACHE") or user_cache_dir("qpcbuild"))


def _make_read_only(root: Path) -> None:
    # Read-only files make an accidental edit of a cache entry fail loudly.
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@dataclass(frozen=True)
class EntryInfo:
    kind: str
    key: str
    path: Path
    bytes: int
    last_used: float  # epoch seconds
    problems: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "path": str(self.path), "bytes": self.bytes,
                "last_used": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.last_used)),
                "ok": not self.problems, "problems": list(self.problems)}


class Cache:
    keeps = True  # entries outlive the build

    def __init__(self, root: Path | None = None, say: Say | None = None):
        self.root = Path(root) if root else default_cache_dir()
        self.say = say or (lambda message: None)

    def entry(self, kind: str, key: str) -> Path:
        return self.root / kind / key

    def ensure_usable(self) -> None:
        """Create the cache's folders, or say why they cannot be (before any work is done)."""
        try:
            (self.root / "locks").mkdir(parents=True, exist_ok=True)
            probe = Path(tempfile.mkstemp(dir=self.root / "locks", prefix=".probe-")[1])
            probe.unlink()
        except OSError as exc:
            raise UsageError(f"cache folder {self.root} is not usable: "
                             f"{exc.strerror or exc}; pass --cache-dir or set QPCBUILD_CACHE") \
                from None

    def _lock(self, kind: str, key: str, timeout: float = -1) -> FileLock:
        self.ensure_usable()
        return FileLock(str(self.root / "locks" / f"{kind}-{key}.lock"), timeout=timeout)

    def problems(self, kind: str, key: str) -> list[str]:
        """Why the entry cannot be used as it is (empty: intact)."""
        final = self.entry(kind, key)
        if final.is_symlink():  # its content would live outside the cache, unchecked
            return ["a link, not a folder of the cache"]
        if not final.is_dir():
            return ["not a folder"]
        try:
            record = json.loads((final / META).read_text())
            recorded = record["files"]
            if record.get("format") != ENTRY_FORMAT:
                return [f"entry format {record.get('format')!r} is not {ENTRY_FORMAT}"]
        except FileNotFoundError:
            return ["never finished (no record)"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [f"unreadable record ({exc})"]
        try:
            actual = hash_tree(final, exclude=[META])
        except (OSError, UsageError) as exc:
            return [f"unreadable ({exc})"]
        found = [f"{p}: changed since the entry was created" for p in sorted(recorded)
                 if p in actual and actual[p]["sha256"] != recorded[p]["sha256"]]
        found += [f"{p}: missing" for p in sorted(set(recorded) - set(actual))]
        found += [f"{p}: not part of the entry" for p in sorted(set(actual) - set(recorded))]
        return found

    def unread_problems(self, kind: str, key: str) -> list[str]:
        """Problems of a local entry a build uses by its record alone (an export whose graph
        nothing here reads), which would otherwise be called reused and stay damaged. Hashed
        only when its files' lstat state differs from the last check that passed (an edit
        changes ctime); an entry only the remote tier holds is checked when fetched."""
        final, memo = self.entry(kind, key), self.root / "checked" / f"{kind}-{key}"
        if not os.path.lexists(final):
            return []
        state = lstat_state(final)
        with contextlib.suppress(OSError):
            if state and memo.read_text() == state:
                return []
        problems = self.problems(kind, key)
        if not problems and state:
            with contextlib.suppress(OSError):  # only a later build's shortcut is lost
                memo.parent.mkdir(exist_ok=True)
                memo.write_text(state)
        return problems

    def get_or_build(self, kind: str, key: str, build: Callable[[Path], dict[str, Any]],
                     inputs: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any], bool]:
        """Return (entry folder, its metadata, reused?). `build(tmp)` fills a fresh folder;
        `inputs` (what the key is a digest of) is kept in the entry's record."""
        final = self.entry(kind, key)
        with self._lock(kind, key):
            if os.path.lexists(final):
                problems = self.problems(kind, key)
                if not problems:
                    os.utime(final)  # last use, for `cache prune --days`
                    return final, json.loads((final / META).read_text())["meta"], True
                if (final / META).exists():  # an unfinished entry is silently replaced
                    self.say(f"cache entry {kind}/{key} is damaged ({'; '.join(problems[:3])}); "
                             "rebuilding it")
                if not _remove(final):
                    raise UsageError(f"cache entry {final} is damaged and cannot be removed; "
                                     "remove it by hand or use another --cache-dir")
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
            try:
                meta = build(tmp)
                record = {"format": ENTRY_FORMAT, "kind": kind, "key": key, "meta": meta,
                          "files": self._files(tmp), **({"inputs": inputs} if inputs else {})}
                (tmp / META).write_text(json.dumps(record, indent=1, default=str) + "\n")
                _make_read_only(tmp)
                os.replace(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return final, meta, False

    def _files(self, tmp: Path) -> dict[str, dict]:
        """The digests recorded for a freshly made entry."""
        return hash_tree(tmp)

    def origin(self, kind: str, key: str, reused: bool) -> str:
        """Where the last get_or_build of this entry got it: local | remote | built."""
        return "local" if reused else "built"

    def has(self, kind: str, key: str) -> bool:
        """Is there a finished entry (not checked: get_or_build checks it on use)? An entry
        that is a link is not one: its record would come from outside the cache."""
        entry = self.entry(kind, key)
        return not entry.is_symlink() and (entry / META).is_file()

    def record_meta(self, kind: str, key: str) -> dict[str, Any] | None:
        """A finished entry's metadata without using its files, or None."""
        if not self.has(kind, key):
            return None
        try:
            return json.loads((self.entry(kind, key) / META).read_text())["meta"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def deliver(self, entry: Path, dst: Path, skip: tuple[str, ...] = (),
                known: DeliveredFiles | None = None, copy: bool = False) -> None:
        """Put an entry's files (or a folder of them) into a bundle: copies, so the bundle can
        never reach the cache. `known` learns the digests the entry recorded for them: the
        entry was checked against its record by the get_or_build that returned it (hashed
        when made or pulled, re-hashed when reused), and a copy has the same bytes. A bundle
        that is pushed as it is built (`known.by_reference`) gets no copies unless `copy`
        (something will read them there): `known` learns where each file's bytes are."""
        recorded = {rel: meta for rel, meta in
                    (self._recorded_files(entry) if known is not None else {}).items()
                    if rel not in skip and rel.split("/")[0] not in skip}
        if known is not None and known.by_reference and recorded and not copy:
            for rel, meta in recorded.items():
                known.add_elsewhere(Path(dst) / rel, meta, self.source_of(entry, rel))
            return
        copy_tree(self.materialize(entry), dst, skip=skip)
        for rel, meta in recorded.items():
            known.add(Path(dst) / rel, meta)

    def source_of(self, entry: Path, rel: str) -> object:
        """Where the bytes of the entry's file `rel` are (a path; the remote tier may name a
        blob in the registry instead)."""
        return Path(entry) / rel

    def materialize(self, entry: Path) -> Path:
        """The entry's folder with its files in it (the remote tier may have only named them
        so far: see RemoteCache.defer_remote_bytes)."""
        return Path(entry)

    def defer_remote_bytes(self) -> None:
        """Entries only the remote tier has stay there until their bytes are needed here
        (a local cache has nothing to defer)."""

    def _recorded_files(self, folder: Path) -> dict[str, dict]:
        """The record's digests of the files under `folder` (an entry or a folder in one),
        relative to it; {} when `folder` is not inside this cache or has no record."""
        try:
            kind, key, *sub = Path(folder).relative_to(self.root).parts
            record = self._record_files(kind, key)
        except (ValueError, OSError, KeyError, TypeError):
            return {}
        prefix = "".join(f"{part}/" for part in sub)
        return {rel[len(prefix):]: meta for rel, meta in record.items()
                if rel.startswith(prefix)}

    def _record_files(self, kind: str, key: str) -> dict[str, dict]:
        return json.loads((self.entry(kind, key) / META).read_text())["files"]

    # ------------------------------------------------------------ weights identity
    def weights_digest(self, files: list[Path]) -> str:
        """SHA-256 over the weight and config files' contents, remembered per file state
        (size, mtime, inode, ctime) so an unchanged model is hashed once per machine."""
        return weights_digest(files, self.root / "digests")

    # ------------------------------------------------------------ maintenance
    def entries(self, check: bool = False) -> list[EntryInfo]:
        """Every entry, and the random smoke checkpoints older versions kept here (kind
        "smoke"; never reused, so `prune` removes them)."""
        found = []
        for kind in (*KINDS, SMOKE):
            folder = self.root / kind
            if not folder.is_dir():
                continue
            for path in sorted(p for p in folder.iterdir() if not p.name.startswith(".")):
                problems = tuple(self.problems(kind, path.name)) if check and kind != SMOKE \
                    else ()
                found.append(EntryInfo(kind, path.name, path, _size(path), path.lstat().st_mtime,
                                       problems))
        return found

    def other_items(self) -> list[tuple[str, int]]:
        """What else the cache folder holds, with its size: the cache's bookkeeping (locks,
        weight digests), interrupted builds' debris and anything not qpcbuild's."""
        if not self.root.is_dir():
            return []
        return [(p.name, _size(p)) for p in sorted(self.root.iterdir())
                if p.name not in (*KINDS, SMOKE) or not p.is_dir()] + \
            [(f"{kind}/{p.name}", _size(p)) for kind in (*KINDS, SMOKE)
             if (self.root / kind).is_dir() for p in sorted((self.root / kind).glob(".*"))]

    def remove_debris(self) -> list[str]:
        """Temp folders of builds that were killed (nobody holds their key's lock)."""
        removed = []
        for kind in KINDS:
            folder = self.root / kind
            for tmp in sorted(folder.glob(".*")) if folder.is_dir() else []:
                try:
                    with self._lock(kind, tmp.name[1:].split(".")[0], timeout=0):
                        shutil.rmtree(tmp, ignore_errors=True)
                        removed.append(f"{kind}/{tmp.name} (debris of an interrupted build)")
                except Timeout:  # a build is writing it right now
                    continue
        return removed

    def prune(self, older_than_days: float | None = None) -> list[str]:
        """Remove the debris of killed builds, damaged or unfinished entries, and (with
        `older_than_days`) entries not used for that long. Returns what was removed."""
        removed = self.remove_debris()
        cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
        entries = self.entries()
        with step(f"checking {self.root}", len(entries), "entries") as advance:
            for entry in entries:
                advance(1)
                try:
                    with self._lock(entry.kind, entry.key, timeout=0):
                        if entry.kind == SMOKE:
                            reason = "random smoke weights: a check, not an artifact"
                        elif self.problems(entry.kind, entry.key):
                            reason = "damaged or unfinished"
                        elif cutoff is not None and entry.path.lstat().st_mtime < cutoff:
                            reason = f"not used for {older_than_days:g} days"
                        else:
                            continue
                        if not _remove(entry.path):
                            continue
                        removed.append(f"{entry.kind}/{entry.key} ({reason})")
                except Timeout:  # a build is using this entry right now
                    continue
        return removed


def _remove(path: Path) -> bool:
    """Remove an entry whatever it has become: a folder, a file, or a link (never its target).
    Returns whether it is gone."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path)
    except OSError:
        pass
    return not os.path.lexists(path)


def weights_digest(files: list[Path], memo_dir: Path | None = None) -> str:
    lines = []
    for f in sorted(files, key=lambda p: p.name):
        memo = None
        if memo_dir is not None:
            st = f.stat()
            state = f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_ctime_ns}"
            memo = memo_dir / (hashlib.sha256(state.encode()).hexdigest()[:32] + ".sha256")
        try:
            digest = memo.read_text().strip() if memo else ""
        except OSError:
            digest = ""
        if len(digest) != 64:
            digest = file_digest(f)
            if memo:
                memo_dir.mkdir(exist_ok=True)
                memo.write_text(digest + "\n")
        lines.append(f"{f.name}\0{digest}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


class ScratchCache:
    """No cache (`compile --no-cache`): every artifact is built in a scratch folder of this one
    build and moved, not copied, into the bundle. A one-shot build (a fresh CI container)
    then needs disk for one copy of the graphs, not two, and nothing outlives the build."""
    keeps = False

    def __init__(self, root: Path):
        self.root = Path(root)

    def ensure_usable(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def remove_debris(self) -> list[str]:
        return []

    def get_or_build(self, kind: str, key: str, build: Callable[[Path], dict[str, Any]],
                     inputs: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any], bool]:
        folder = self.root / kind / key
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder, build(folder), False

    def origin(self, kind: str, key: str, reused: bool) -> str:
        return "built"

    def has(self, kind: str, key: str) -> bool:
        return False

    def unread_problems(self, kind: str, key: str) -> list[str]:
        return []

    def record_meta(self, kind: str, key: str) -> dict[str, Any] | None:
        return None  # (it keeps no entries)

    def deliver(self, entry: Path, dst: Path, skip: tuple[str, ...] = (),
                known: DeliveredFiles | None = None, copy: bool = False) -> None:
        copy_tree(entry, dst, skip=skip, move=True)  # built here, never hashed: nothing known

    def materialize(self, entry: Path) -> Path:
        return Path(entry)

    def defer_remote_bytes(self) -> None:
        pass

    def weights_digest(self, files: list[Path]) -> str:
        return weights_digest(files)

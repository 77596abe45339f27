"""The build cache's second tier: a registry repository with one tag per cache entry
(`KIND-KEY`), shared by every machine that builds with `--remote-cache REGISTRY/REPO`.

The local cache stays the first tier and the only place a build reads from: a local miss
asks the registry; a hit is downloaded (each layer checked against its digest) into the local
entry being created, a miss is built and then pushed, with the key's inputs as annotations so
a person can tell why two keys differ. Two builders racing on one key both build (or pull)
into their own local caches and both push the same tag; either manifest is complete, because
a manifest is only put after all its blobs. A registry that is down, refuses or sends damaged
bytes costs a warning and a local build, unless the remote tier is required.
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..cache import META, Cache
from ..delivered import sealed_fields
from ..errors import UsageError
from .artifact import download_folder, layer_files, push_folder, read_artifact
from .client import RegistryClient
from .errors import RegistryError, RegistryNotFound, RegistryUnavailable
from .reference import parse_reference

CACHE_ARTIFACT = "application/vnd.qpcbuild.cache-entry.v1"
CACHE_RECORD = "application/vnd.qpcbuild.cache-entry.record.v1+json"
ANNOTATION = "vnd.qpcbuild.cache."  # + kind, key, input.<name>


def _flatten(prefix: str, value: Any) -> dict[str, str]:
    if isinstance(value, dict):
        return {k: v for key in sorted(value) for k, v in
                _flatten(f"{prefix}.{key}", value[key]).items()}
    return {prefix: value if isinstance(value, str) else json.dumps(value)}


class RemoteCache(Cache):
    def __init__(self, root: Path | None, remote: str, required: bool = False,
                 insecure: bool = False, say: Callable[[str], None] | None = None):
        super().__init__(root, say)
        self.remote = parse_reference(remote, "--remote-cache", tag_allowed=False)
        if self.remote.digest:
            raise UsageError(f"--remote-cache {remote}: give a repository, not a digest")
        self.client = RegistryClient(self.remote.registry, insecure)
        self.required = required
        self.down: str | None = None  # why the remote tier is skipped for the rest of the build
        self.origins: dict[tuple[str, str], str] = {}
        self._warned = threading.Lock()
        self._pulled: dict[Path, dict[str, dict]] = {}  # entry folder -> its checked digests
        # (kind, key) -> the registry's entry as _remote_entry found it (None: unusable), so
        # that has(), record_meta() and the pull read each artifact's manifest once
        self._looked_up: dict[tuple[str, str], tuple[dict, dict[str, dict]] | None] = {}
        self._defer = False  # defer_remote_bytes: remote hits are named, not downloaded
        # (kind, key) -> (its checked files, and how to get the entry when its bytes are needed)
        self._deferred: dict[tuple[str, str], tuple[dict[str, dict], Callable, dict | None]] = {}

    def tag(self, kind: str, key: str) -> str:
        return f"{kind}-{key}"

    def where(self, kind: str, key: str) -> str:
        return f"{self.remote.registry}/{self.remote.repository}:{self.tag(kind, key)}"

    def origin(self, kind: str, key: str, reused: bool) -> str:
        return self.origins.get((kind, key), "local" if reused else "built")

    def has(self, kind: str, key: str) -> bool:
        if super().has(kind, key):
            return True
        return self._remote_record(kind, key) is not None

    def record_meta(self, kind: str, key: str) -> dict[str, Any] | None:
        meta = super().record_meta(kind, key)
        if meta is not None:  # a local entry the registry lacks is shared, as on a local hit
            self._push(kind, key, self.entry(kind, key), only_if_missing=True)
        else:
            record = self._remote_record(kind, key)
            meta = record.get("meta") if isinstance(record, dict) else None
            if meta is not None:
                self.origins[(kind, key)] = "remote"
        return meta

    def _remote_record(self, kind: str, key: str) -> dict | None:
        """The remote entry's record (its config blob: small), or None when there is none."""
        found = self._remote_entry(kind, key)
        return found[0] if found else None

    def _files(self, tmp: Path) -> dict[str, dict]:
        # A pulled entry was hashed as it arrived; a built one is hashed now.
        return self._pulled.pop(tmp, None) or super()._files(tmp)

    # ------------------------------------------------------------ entries left in the registry
    def defer_remote_bytes(self) -> None:
        """For a bundle pushed as it is built (compile --push): an entry only the registry
        has is returned at its local path without being downloaded; its files are delivered
        by reference (RemoteBlob) and the push mounts them from this repository. Whatever
        needs the bytes here (a build from a graph) calls materialize() first."""
        self._defer = True

    def source_of(self, entry: Path, rel: str) -> object:
        # A local entry is in the registry too (shared when it was used), so the push mounts
        # it like a remote one and uploads the local file only where the mount is refused.
        local = None if self._deferred_key(entry) else super().source_of(entry, rel)
        if self.down and local is not None:
            return local
        return RemoteBlob(self.client, self.remote.repository, local)

    def materialize(self, entry: Path) -> Path:
        found = self._deferred_key(entry)
        if found is None:
            return Path(entry)
        _, build, inputs = self._deferred[found]
        entry = self._pull_or_build(*found, build, inputs)[0]
        self._deferred.pop(found, None)  # its files are here now
        return entry

    def _deferred_key(self, entry: Path) -> tuple[str, str] | None:
        try:
            kind, key = Path(entry).relative_to(self.root).parts[:2]
        except ValueError:
            return None
        return (kind, key) if (kind, key) in self._deferred else None

    def _record_files(self, kind: str, key: str) -> dict[str, dict]:
        if (kind, key) in self._deferred:
            return self._deferred[(kind, key)][0]
        return super()._record_files(kind, key)

    def get_or_build(self, kind: str, key: str, build: Callable[[Path], dict[str, Any]],
                     inputs: dict[str, Any] | None = None
                     ) -> tuple[Path, dict[str, Any], bool]:
        if self._defer and not super().has(kind, key):
            found = self._remote_entry(kind, key)
            if found is not None:
                record, files = found
                self._deferred[(kind, key)] = ({p: sealed_fields(m) for p, m in files.items()},
                                               build, inputs)
                self.origins[(kind, key)] = "remote"
                return self.entry(kind, key), record["meta"], True
        return self._pull_or_build(kind, key, build, inputs)

    def _pull_or_build(self, kind: str, key: str, build: Callable[[Path], dict[str, Any]],
                       inputs: dict[str, Any] | None) -> tuple[Path, dict[str, Any], bool]:
        """The local entry: reused, else pulled from the registry, else built and pushed."""
        pulled = []

        def pull_or_build(tmp: Path) -> dict[str, Any]:
            meta = self._pull(kind, key, tmp)
            if meta is not None:
                pulled.append(kind)
                return meta
            return build(tmp)

        entry, meta, reused = super().get_or_build(kind, key, pull_or_build, inputs)
        origin = "local" if reused else "remote" if pulled else "built"
        self.origins[(kind, key)] = origin
        if origin != "remote":  # a local entry the registry lacks is shared too
            self._push(kind, key, entry, only_if_missing=reused)
        return entry, meta, reused or bool(pulled)

    # ------------------------------------------------------------ the registry side
    def _skip(self, exc: RegistryError, doing: str) -> None:
        """A failing remote: fatal when required, else one warning and no more remote calls."""
        if self.required:
            raise RegistryError(f"remote cache ({doing}): {exc}; --remote-cache-required is "
                                "set, so the build stops") from None
        with self._warned:
            if self.down is None:
                self.down = str(exc)
                self.say(f"remote cache {self.remote.registry}/{self.remote.repository} not "
                         f"used for the rest of this build ({doing}: {exc}); building locally")

    def _remote_entry(self, kind: str, key: str) -> tuple[dict, dict[str, dict]] | None:
        """The registry's entry for the key: its record and its layers' files, checked to
        describe this entry; None when there is none, or it cannot be used (said once)."""
        if self.down:
            return None
        if (kind, key) in self._looked_up:
            return self._looked_up[(kind, key)]
        tag = self.tag(kind, key)
        try:
            oci, _, raw = read_artifact(self.client, self.remote.repository, tag, CACHE_ARTIFACT)
        except RegistryNotFound:
            return None
        except RegistryError as exc:  # down, or refusing us
            self._skip(exc, f"looking up {tag}")
            return None
        try:
            record = json.loads(raw)
            files = layer_files(oci, self.where(kind, key))
            recorded = {p: {"size": m["size"], "sha256": m["sha256"],
                            "executable": bool(m.get("executable"))}
                        for p, m in record["files"].items()}
            if record.get("kind") != kind or record.get("key") != key or recorded != files \
                    or not isinstance(record.get("meta"), dict):
                raise RegistryError("its record and layers do not describe this entry")
            found = record, files
        except (RegistryError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.say(f"remote cache entry {self.where(kind, key)} is unusable ({exc}); "
                     "building it here")
            found = None
        self._looked_up[(kind, key)] = found  # (not a miss: a racing builder may push it)
        return found

    def _pull(self, kind: str, key: str, tmp: Path) -> dict[str, Any] | None:
        """Fill `tmp` from the registry and return the entry's metadata, or None (a miss)."""
        found = self._remote_entry(kind, key)
        if found is None:
            return None
        record, files = found
        tag = self.tag(kind, key)
        try:
            download_folder(self.client, self.remote.repository, files, tmp)
            self._pulled[tmp] = {p: sealed_fields(m) for p, m in files.items()}
            return record["meta"]
        except RegistryUnavailable as exc:
            self._skip(exc, f"pulling {tag}")
        except RegistryError as exc:  # damaged bytes, a blob gone missing: not our entry
            self.say(f"remote cache entry {self.where(kind, key)} is unusable ({exc}); "
                     "building it here")
        for child in list(tmp.iterdir()):  # the local build starts from an empty folder
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        return None

    def _push(self, kind: str, key: str, entry: Path, only_if_missing: bool) -> None:
        if self.down:
            return
        repo, tag = self.remote.repository, self.tag(kind, key)
        try:
            if only_if_missing:
                try:
                    self.client.get_manifest(repo, tag)
                    return
                except RegistryNotFound:
                    pass
            raw = (entry / META).read_bytes()
            record = json.loads(raw)
            annotations = {f"{ANNOTATION}kind": kind, f"{ANNOTATION}key": key,
                           **_flatten(f"{ANNOTATION}input", record.get("inputs") or {})}
            push_folder(self.client, repo, tag, entry, record["files"], raw, CACHE_RECORD,
                        CACHE_ARTIFACT, annotations)
        except RegistryError as exc:
            self._skip(exc, f"pushing {tag}")


@dataclass(frozen=True)
class RemoteBlob:
    """A bundle file delivered by reference from the remote cache: a blob in `repository`,
    and, for an entry of the local cache, also the file `local`."""
    client: RegistryClient
    repository: str
    local: Path | None = None

    def copy_to(self, client: RegistryClient, repo: str, digest: str, size: int,
                scratch: Path) -> bool:
        """Put the blob into `repo` on `client`'s registry: mounted from the cache's repository
        (no bytes move) on the same registry, else uploaded from the local file or downloaded
        into `scratch` (checked) and uploaded. True when bytes were uploaded."""
        if client.has_blob(repo, digest):
            return False
        if client.registry == self.client.registry and \
                client.mount_blob(repo, digest, self.repository):
            return False
        if self.local is not None:
            return client.push_blob(repo, digest, size, path=self.local)
        tmp = scratch / f".blob-{digest.partition(':')[2][:16]}"
        try:
            self.client.download_blob(self.repository, digest, size, tmp)
            return client.push_blob(repo, digest, size, path=tmp)
        finally:
            tmp.unlink(missing_ok=True)


def open_cache(root: Path | None, remote: str | None, required: bool = False,
               insecure: bool = False, say: Callable[[str], None] | None = None) -> Cache:
    """The local cache, with the registry tier behind it when `remote` names a repository."""
    if not remote:
        if required:
            raise UsageError("--remote-cache-required needs --remote-cache REGISTRY/REPOSITORY "
                             "(or $QPCBUILD_REMOTE_CACHE)")
        return Cache(root, say=say)
    return RemoteCache(root, remote, required, insecure, say)

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
from pathlib import Path
from typing import Any, Callable

from ..cache import META, Cache
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
        if self.down:
            return None
        try:
            _, _, raw = read_artifact(self.client, self.remote.repository, self.tag(kind, key),
                                      CACHE_ARTIFACT)
            return json.loads(raw)
        except RegistryNotFound:
            return None
        except RegistryError as exc:
            self._skip(exc, f"looking up {self.tag(kind, key)}")
        except ValueError:
            pass
        return None

    def _files(self, tmp: Path) -> dict[str, dict]:
        # A pulled entry was hashed as it arrived; a built one is hashed now.
        return self._pulled.pop(tmp, None) or super()._files(tmp)

    def get_or_build(self, kind: str, key: str, build: Callable[[Path], dict[str, Any]],
                     inputs: dict[str, Any] | None = None
                     ) -> tuple[Path, dict[str, Any], bool]:
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

    def _pull(self, kind: str, key: str, tmp: Path) -> dict[str, Any] | None:
        """Fill `tmp` from the registry and return the entry's metadata, or None (a miss)."""
        if self.down:
            return None
        repo, tag = self.remote.repository, self.tag(kind, key)
        try:
            oci, _, raw = read_artifact(self.client, repo, tag, CACHE_ARTIFACT)
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
            if record.get("kind") != kind or record.get("key") != key or recorded != files:
                raise RegistryError("its record and layers do not describe this entry")
            download_folder(self.client, repo, files, tmp)
            self._pulled[tmp] = {p: {"size": m["size"], "sha256": m["sha256"],
                                     **({"executable": True} if m["executable"] else {})}
                                 for p, m in files.items()}
            return record["meta"]
        except RegistryUnavailable as exc:
            self._skip(exc, f"pulling {tag}")
        except (RegistryError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # damaged bytes, a blob gone missing, a record that does not fit: not our entry
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


def open_cache(root: Path | None, remote: str | None, required: bool = False,
               insecure: bool = False, say: Callable[[str], None] | None = None) -> Cache:
    """The local cache, with the registry tier behind it when `remote` names a repository."""
    if not remote:
        if required:
            raise UsageError("--remote-cache-required needs --remote-cache REGISTRY/REPOSITORY "
                             "(or $QPCBUILD_REMOTE_CACHE)")
        return Cache(root, say=say)
    return RemoteCache(root, remote, required, insecure, say)

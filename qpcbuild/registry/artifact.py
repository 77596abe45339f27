"""Folders of files as OCI artifacts: one layer per file, so a file two artifacts share (a
target's graph in two bundles, an export in a bundle and the cache) is stored once.

Each layer carries the file's relative path in `org.opencontainers.image.title`, which is how
ORAS names files, so a stock `oras pull` restores the folder too. The config blob is the
folder's own record (a bundle's manifest.json, a cache entry's record), under a media type of
ours, and says what every layer must hash to before any byte is downloaded.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..bundle.manifest import check_relative
from ..errors import BundleError
from ..progress import step
from .client import OCI_MANIFEST, RegistryClient, encode_manifest, sha256_digest
from .errors import RegistryDigestMismatch, RegistryError
from .resume import LocalBlobs

TITLE = "org.opencontainers.image.title"
EXECUTABLE = "vnd.qpcbuild.file.executable"
FILE_LAYER = "application/vnd.qpcbuild.file.v1"
Say = Callable[[str], None]


@dataclass(frozen=True)
class Transfer:
    digest: str  # the OCI manifest's digest, to pin
    files: int
    bytes: int
    sent: int  # bytes that actually crossed the wire (the rest the registry had already)
    manifest_size: int = 0  # for a descriptor of the manifest (a referrer's subject)

    def to_dict(self) -> dict:
        return {"digest": self.digest, "files": self.files, "bytes": self.bytes,
                "transferred_bytes": self.sent}


def _largest_beside_rest(files: dict[str, dict], transfer: Callable[[str, dict], object]
                         ) -> dict[str, object]:
    """{path: transfer(path, meta)}: the largest file in this thread, the others meanwhile in
    one more. A bundle is one big graph and small files, and the registry hashes an upload on
    one core, so the small ones go up (or down) beside the big one instead of after it. The
    big one stays in this thread so that Ctrl-C stops it at once; a failure drops the small
    files not started and waits only for the one under way."""
    order = sorted(files, key=lambda rel: (-files[rel]["size"], rel))
    if not order:
        return {}
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layers")
    try:
        rest = {rel: pool.submit(transfer, rel, files[rel]) for rel in order[1:]}
        done = {order[0]: transfer(order[0], files[order[0]])}
        return {**done, **{rel: future.result() for rel, future in rest.items()}}
    finally:
        pool.shutdown(cancel_futures=True)


def push_folder(client: RegistryClient, repo: str, tag: str, root: Path,
                files: dict[str, dict], config: bytes, config_type: str, artifact_type: str,
                annotations: dict[str, str], say: Say | None = None,
                sources: dict[str, object] | None = None) -> Transfer:
    """Upload `files` ({relative path: {size, sha256[, executable]}}) under `root` as layers,
    then the config and the manifest under `tag`. The registry checks each blob against the
    digest we name, so a file that changed since it was hashed is refused, not published.
    `sources`: files whose bytes are elsewhere, a path or a blob with a `copy_to` (a bundle
    pushed as it is built: cache.DeliveredFiles.sources)."""
    say = say or (lambda m: None)
    sources = sources or {}

    def upload(rel: str, meta: dict) -> bool:
        digest = f"sha256:{meta['sha256']}"
        source = sources.get(rel, root / rel)
        try:
            if isinstance(source, Path):
                sent_now = client.push_blob(repo, digest, meta["size"], path=source,
                                            advance=advance)
            else:  # (a mounted or cache-delivered blob: counted whole when it is there)
                sent_now = source.copy_to(client, repo, digest, meta["size"], root)
                advance(meta["size"])
        except RegistryDigestMismatch:
            raise BundleError(f"{root / rel}: its bytes do not hash to the recorded digest "
                              f"{digest} (the registry refused them); nothing was tagged") \
                from None
        if not sent_now and isinstance(source, Path):
            advance(meta["size"])
        say(f"pushed {rel} ({meta['size']:,} bytes)" if sent_now
            else f"{rel}: already in the registry")
        return sent_now

    with step(f"pushing {len(files)} files to {client.registry}/{repo}",
              sum(m["size"] for m in files.values()), "bytes") as advance:
        sent = _largest_beside_rest(files, upload)
    layers = [{"mediaType": FILE_LAYER, "digest": f"sha256:{meta['sha256']}",
               "size": meta["size"],
               "annotations": {TITLE: rel, **({EXECUTABLE: "true"}
                                              if meta.get("executable") else {})}}
              for rel, meta in sorted(files.items())]
    config_digest = sha256_digest(config)
    client.push_blob(repo, config_digest, len(config), data=config)
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
                "config": {"mediaType": config_type, "digest": config_digest,
                           "size": len(config)},
                "layers": layers, "annotations": annotations}
    digest = client.put_manifest(repo, tag, manifest)
    return Transfer(digest, len(files), sum(m["size"] for m in files.values()),
                    sum(files[rel]["size"] for rel, now in sent.items() if now),
                    len(encode_manifest(manifest)))


def read_artifact(client: RegistryClient, repo: str, reference: str,
                  artifact_type: str) -> tuple[dict, str, bytes]:
    """(OCI manifest, its digest, config blob) of one of our artifacts; anything else is
    refused before a layer is downloaded."""
    manifest, digest = client.get_manifest(repo, reference)
    config = manifest.get("config") if isinstance(manifest, dict) else None
    if manifest.get("artifactType") != artifact_type or not isinstance(config, dict):
        kind = manifest.get("artifactType") or (config or {}).get("mediaType") or "unknown"
        raise RegistryError(f"{client.registry}/{repo}:{reference} is not a "
                            f"{artifact_type} artifact (it is {kind})")
    return manifest, digest, client.read_blob(repo, config["digest"])


def layer_files(manifest: dict, where: str) -> dict[str, dict]:
    """{relative path: {size, sha256, executable}} from the layers' titles, paths checked."""
    files = {}
    for n, layer in enumerate(manifest.get("layers") or []):
        try:
            rel = check_relative((layer.get("annotations") or {}).get(TITLE), f"layers[{n}]")
            algorithm, _, hexdigest = layer["digest"].partition(":")
            size = int(layer["size"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise RegistryError(f"{where}: layer {n} lacks a digest, size or title") from None
        if algorithm != "sha256" or rel in files:
            raise RegistryError(f"{where}: layer {n} ({rel}) is a duplicate or not sha256")
        files[rel] = {"size": size, "sha256": hexdigest,
                      "executable": layer["annotations"].get(EXECUTABLE) == "true"}
    return files


def download_folder(client: RegistryClient, repo: str, files: dict[str, dict], dest: Path,
                    say: Say | None = None, local: LocalBlobs | None = None) -> int:
    """Download every file into `dest` (which the caller discards on failure), each checked
    against its digest as it arrives. `local`: verified copies already on this machine, used
    instead of a download, and kept for a resumed pull as each download finishes. Returns the
    bytes downloaded."""
    say = say or (lambda m: None)
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)

    def download(rel: str, meta: dict) -> int:
        target = dest / rel
        found = local.place(rel, meta, target) if local else None
        got = 0
        if found is None:
            resume = local.start(meta, target) if local else False
            try:
                got = client.download_blob(repo, f"sha256:{meta['sha256']}", meta["size"],
                                           target, what=rel, advance=advance, resume=resume)
            except RegistryDigestMismatch:
                if local:
                    local.failed(meta)
                raise
            if local:
                local.keep(meta, target)
            if resume:
                found = f"resumed at byte {meta['size'] - got:,} of an interrupted pull"
        else:
            advance(meta["size"])
        if meta.get("executable"):
            os.chmod(target, 0o755)
        say(f"pulled {rel} ({meta['size']:,} bytes)" if found is None
            else f"{rel}: {found} (verified), " + (f"{got:,} bytes downloaded" if got
                                                   else "not downloaded"))
        return got

    with step(f"pulling {len(files)} files from {client.registry}/{repo}",
              sum(m["size"] for m in files.values()), "bytes") as advance:
        return sum(_largest_beside_rest(files, download).values())

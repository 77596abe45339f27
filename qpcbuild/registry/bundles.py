"""Bundles in a registry: `push` a verified bundle, `pull` one into place, and the local store
that lets `run`, `serve`, `inspect` and `verify` take a reference.

A pull is checked three times before anything is renamed into place: the OCI manifest (by
digest when pinned), the config blob (our manifest.json: its bundle id must match its content
and the annotation) and every layer (digest and size against manifest.json's file list, the
bytes hashed as they arrive). It lands in a staging folder that any failure removes.

A bundle's signatures.json travels beside it, not in it: push attaches it as an OCI referrer of
the bundle's manifest (referrers.py), pull brings every signature referrer back into
signatures.json and, asked to, refuses a bundle without a valid signature by a given key.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_data_dir

from ..bundle.manifest import (MANIFEST, SIGNATURES, Manifest, SealedManifest,
                               manifest_from_json)
from ..bundle.signature import (check_signature, parse_signatures, read_public_key,
                                read_signatures, write_signatures)
from ..bundle.staging import check_writable_parent, publish, remove_debris, staging_folder
from ..bundle.verify import verify_bundle
from ..errors import BundleError, UsageError
from . import referrers
from .artifact import Say, Transfer, download_folder, layer_files, push_folder, read_artifact
from .client import OCI_MANIFEST, RegistryClient
from .errors import RegistryError
from .reference import Reference, carries_credentials, looks_like_reference, parse_reference
from .resume import LocalBlobs

BUNDLE_ARTIFACT = "application/vnd.qpcbuild.bundle.v1"
BUNDLE_CONFIG = "application/vnd.qpcbuild.bundle.manifest.v1+json"
ANNOTATION = "vnd.qpcbuild.bundle."  # + id, name, method, ks, toolchain
SIGNATURES_ARTIFACT = "application/vnd.qpcbuild.signatures.v1+json"
MAX_SIGNATURES_BLOB = 1 << 20


def store_dir() -> Path:
    """Where referenced bundles are pulled to (one folder per manifest digest)."""
    return Path(os.environ.get("QPCBUILD_STORE") or Path(user_data_dir("qpcbuild")) / "bundles")


def bundle_annotations(m: Manifest) -> dict[str, str]:
    return {f"{ANNOTATION}id": m.bundle_id, f"{ANNOTATION}name": m.name,
            f"{ANNOTATION}method": m.speculation.method,
            f"{ANNOTATION}ks": ",".join(str(k) for k in m.ks),
            f"{ANNOTATION}toolchain": json.dumps(m.toolchain, sort_keys=True,
                                                 separators=(",", ":")),
            "org.opencontainers.image.title": m.name}


def push_bundle(bundle: Path, ref: Reference, client: RegistryClient,
                say: Say | None = None) -> tuple[Transfer, int]:
    """Upload a bundle under `ref`'s tag, then its signatures.json (if any) as a referrer.
    Returns (the transfer, the number of signatures attached). Checked before any upload: the
    seal (the manifest hashes to its bundle id), every file present with its sealed size,
    nothing extra; during it: every uploaded file's bytes against its sealed digest, by the
    registry (a mismatch is refused and nothing is tagged). Files the registry already holds
    are not read: the artifact names the sealed digests, so what is published is the sealed
    content."""
    if ref.digest:
        raise UsageError(f"{ref}: push to a tag; the registry gives the digest")
    problems = SealedManifest(bundle).changed_fields() + verify_bundle(bundle, fast=True)
    if problems:
        raise BundleError(f"{bundle} does not match its manifest, so it is not pushed: "
                          + "; ".join(problems[:5]))
    signed = read_signatures(bundle)  # a damaged file stops the push before any upload
    transfer = push_assembled(Path(bundle), {}, ref, client, say)
    if signed:
        referrers.attach(client, ref.repository,
                         {"mediaType": OCI_MANIFEST, "digest": transfer.digest,
                          "size": transfer.manifest_size},
                         SIGNATURES_ARTIFACT, (Path(bundle) / SIGNATURES).read_bytes())
    return transfer, len(signed)


def push_assembled(staging: Path, sources: dict[str, object], ref: Reference,
                   client: RegistryClient, say: Say | None = None) -> Transfer:
    """Push a bundle just sealed in `staging` (compile --push), whose delivered files may
    still be where the cache keeps them (`sources`): files in the remote cache's repository
    are mounted, not downloaded; the rest are read from their entry or the staging folder.
    The registry checks every uploaded blob against the sealed digest."""
    raw = (staging / MANIFEST).read_bytes()
    m = manifest_from_json(raw, str(staging / MANIFEST))
    files = {**m.file_list(), MANIFEST: {"size": len(raw), "sha256": _hex(raw)}}
    return push_folder(client, ref.repository, ref.pinned, staging, files, raw, BUNDLE_CONFIG,
                       BUNDLE_ARTIFACT, bundle_annotations(m), say, sources)


def fetch_signatures(client: RegistryClient, repo: str, digest: str, where: str,
                     say: Say | None = None, strict: bool = True) -> list[dict]:
    """Every signature entry attached to the manifest `digest` as a referrer, duplicates
    dropped. A referrer that is not a readable signature file is skipped (said): anyone who
    can push may attach one, and it vouches for nothing; the signatures themselves are
    checked by the caller against the pulled bundle id. Not `strict` (no signature is
    required): a registry whose referrers cannot be listed gives [] and a note, not an error."""
    say = say or (lambda m: None)
    try:
        found = referrers.referrers(client, repo, digest, SIGNATURES_ARTIFACT)
    except RegistryError as exc:
        if strict:
            raise
        say(f"signatures not fetched: {exc}")
        return []
    entries: list[dict] = []
    for descriptor in found:
        try:
            manifest, _ = client.get_manifest(repo, descriptor["digest"])
            layer = (manifest.get("layers") or [None])[0]
            if manifest.get("artifactType") != SIGNATURES_ARTIFACT or \
                    (manifest.get("subject") or {}).get("digest") != digest or \
                    not isinstance(layer, dict):
                raise BundleError("not a signature file of this manifest")
            data = client.read_blob(repo, layer["digest"], limit=MAX_SIGNATURES_BLOB)
            entries += [e for e in parse_signatures(data, "its layer") if e not in entries]
        except (BundleError, RegistryError, KeyError, TypeError, AttributeError) as exc:
            say(f"{where}: ignoring signature referrer {descriptor['digest']}: {exc}")
    return entries


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Pulled:
    bundle_id: str
    digest: str  # the OCI manifest's
    signatures: int
    downloaded: int  # bytes that crossed the wire
    up_to_date: bool  # `out` already held exactly this bundle: nothing was downloaded


def pull_bundle(ref: Reference, out: Path, client: RegistryClient, say: Say | None = None,
                signed_by: Path | None = None) -> Pulled:
    """Download the bundle `ref` names into `out` (replacing a bundle there), with the
    signatures attached to it in the registry. `signed_by`: a public key; the bundle is refused
    unless one of them is a valid signature by it. Nothing appears at `out` unless every check
    passed. A bundle at `out` with the same manifest whose files all hash to it is up to date
    (only its signatures are brought up to date); files already on this machine (unchanged in
    `out`, or kept by an interrupted pull) are verified and copied instead of downloaded."""
    where = str(ref)
    if signed_by is not None:
        read_public_key(signed_by)  # a bad key file is an error before any download
    out = Path(out)  # a bad destination too
    if out.is_symlink() or out.exists() and not (out / MANIFEST).is_file() and (
            not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"-d {out}: exists and is not a qpcbuild bundle; refusing to replace it")
    check_writable_parent(out, "-d")
    oci, digest, raw = read_artifact(client, ref.repository, ref.pinned, BUNDLE_ARTIFACT)
    files = layer_files(oci, where)
    remove_debris(out)
    with staging_folder(out) as staging:
        (staging / MANIFEST).write_bytes(raw)
        try:
            sealed = SealedManifest(staging)
            m = sealed.checked()
        except (BundleError, UsageError) as exc:
            raise BundleError(f"{where}: its config is not a bundle manifest ({exc})") from None
        problems = sealed.changed_fields()
        if problems or (oci.get("annotations") or {}).get(f"{ANNOTATION}id") != m.bundle_id:
            raise BundleError(f"{where}: the manifest does not hash to its bundle id, or the "
                              "artifact's bundle id annotation differs; refusing it"
                              + (f" ({'; '.join(problems[:3])})" if problems else ""))
        _check_layers(files, m.file_list(), raw, where)
        signatures = fetch_signatures(client, ref.repository, digest, where, say,
                                      strict=signed_by is not None)
        if signatures:
            write_signatures(staging, signatures)
        if signed_by is not None:  # before any download: the files are checked against the
            # sealed list the signed bundle id covers, so the signature holds for them too
            check_signature(staging, m.bundle_id, signed_by, where=f"{where} ({digest})")
        if _up_to_date(out, raw):
            if signatures:
                write_signatures(out, signatures)
            return Pulled(m.bundle_id, digest, len(signatures), 0, True)
        local = LocalBlobs(out)
        got = download_folder(client, ref.repository,
                              {rel: meta for rel, meta in files.items() if rel != MANIFEST},
                              staging, say, local)
        publish(staging, out)
        local.discard()
    return Pulled(m.bundle_id, digest, len(signatures), got, False)


def _up_to_date(out: Path, raw: bytes) -> bool:
    """`out` holds this very manifest and every file it seals, digests checked (hashing is
    cheaper than downloading the same bytes again)."""
    try:
        return (out / MANIFEST).read_bytes() == raw and not verify_bundle(out)
    except OSError:
        return False


def _check_layers(layers: dict[str, dict], sealed: dict[str, dict], raw: bytes,
                  where: str) -> None:
    """The layers must be exactly the sealed files (plus manifest.json), digests equal."""
    expected = {**{p: {"size": f["size"], "sha256": f["sha256"],
                       "executable": bool(f.get("executable"))} for p, f in sealed.items()},
                MANIFEST: {"size": len(raw), "sha256": _hex(raw), "executable": False}}
    wrong = sorted(p for p in set(expected) | set(layers) if expected.get(p) != layers.get(p))
    if wrong:
        raise BundleError(f"{where}: layers and the sealed file list differ for "
                          + ", ".join(wrong[:5]) + "; refusing the bundle")


def open_bundle(arg: Path, insecure: bool = False, say: Say | None = None,
                signatures: bool = False) -> Path:
    """A bundle folder for a command that takes BUNDLE: the folder itself, or, for a registry
    reference, the store's copy (pulled unless a copy of that exact manifest is there).
    `signatures`: the caller will check a signature, so a store copy also gets the signatures
    attached in the registry since it was pulled."""
    text = str(arg)
    if Path(arg).exists() or not (looks_like_reference(text) or carries_credentials(text)):
        return Path(arg)
    ref = parse_reference(text, "BUNDLE")
    with RegistryClient(ref.registry, insecure) as client:
        digest = ref.digest or client.get_manifest(ref.repository, ref.pinned)[1]
        folder = store_dir() / digest.replace(":", "-")
        if (folder / MANIFEST).is_file():
            if signatures:
                have = read_signatures(folder)
                new = [e for e in fetch_signatures(client, ref.repository, digest, text, say)
                       if e not in have]
                if new:
                    write_signatures(folder, have + new)
            return folder
        (say or (lambda m: None))(f"pulling {ref} into {folder}")
        pull_bundle(Reference(ref.registry, ref.repository, digest=digest), folder, client)
    return folder

"""Bundles in a registry: `push` a verified bundle, `pull` one into place, and the local store
that lets `run`, `serve`, `inspect` and `verify` take a reference.

A pull is checked three times before anything is renamed into place: the OCI manifest (by
digest when pinned), the config blob (our manifest.json: its bundle id must match its content
and the annotation) and every layer (digest and size against manifest.json's file list, the
bytes hashed as they arrive). It lands in a staging folder that any failure removes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from platformdirs import user_data_dir

from ..bundle.manifest import MANIFEST, changed_fields, read_manifest
from ..bundle.verify import verify_bundle
from ..errors import BundleError, UsageError
from .artifact import Say, Transfer, download_folder, layer_files, push_folder, read_artifact
from .client import RegistryClient
from .reference import Reference, looks_like_reference, parse_reference

BUNDLE_ARTIFACT = "application/vnd.qpcbuild.bundle.v1"
BUNDLE_CONFIG = "application/vnd.qpcbuild.bundle.manifest.v1+json"
ANNOTATION = "vnd.qpcbuild.bundle."  # + id, name, method, ks, toolchain


def store_dir() -> Path:
    """Where referenced bundles are pulled to (one folder per manifest digest)."""
    return Path(os.environ.get("QPCBUILD_STORE") or Path(user_data_dir("qpcbuild")) / "bundles")


def bundle_annotations(m: dict) -> dict[str, str]:
    spec = m["speculation"]
    return {f"{ANNOTATION}id": m["bundle_id"], f"{ANNOTATION}name": m["name"],
            f"{ANNOTATION}method": str(spec.get("method")),
            f"{ANNOTATION}ks": ",".join(str(k) for k in spec.get("num_speculative_tokens", [])),
            f"{ANNOTATION}toolchain": json.dumps(m.get("toolchain"), sort_keys=True,
                                                 separators=(",", ":")),
            "org.opencontainers.image.title": m["name"]}


def push_bundle(bundle: Path, ref: Reference, client: RegistryClient,
                say: Say | None = None) -> Transfer:
    """Upload a bundle under `ref`'s tag. Checked before any upload: the seal (the manifest
    hashes to its bundle id), every file present with its sealed size, nothing extra; during
    it: every uploaded file's bytes against its sealed digest, by the registry (a mismatch
    is refused and nothing is tagged). Files the registry already holds are not read: the
    artifact names the sealed digests, so what is published is the sealed content."""
    if ref.digest:
        raise UsageError(f"{ref}: push to a tag; the registry gives the digest")
    problems = changed_fields(read_manifest(bundle)) + verify_bundle(bundle, fast=True)
    if problems:
        raise BundleError(f"{bundle} does not match its manifest, so it is not pushed: "
                          + "; ".join(problems[:5]))
    raw = (Path(bundle) / MANIFEST).read_bytes()
    m = json.loads(raw)
    files = {**m["files"], MANIFEST: {"size": len(raw), "sha256": _hex(raw)}}
    return push_folder(client, ref.repository, ref.pinned, Path(bundle), files, raw,
                       BUNDLE_CONFIG, BUNDLE_ARTIFACT, bundle_annotations(m), say)


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pull_bundle(ref: Reference, out: Path, client: RegistryClient,
                say: Say | None = None) -> tuple[str, str]:
    """Download the bundle `ref` names into `out` (replacing a bundle there). Returns (bundle
    id, manifest digest). Nothing appears at `out` unless every check passed."""
    where = str(ref)
    oci, digest, raw = read_artifact(client, ref.repository, ref.pinned, BUNDLE_ARTIFACT)
    files = layer_files(oci, where)
    out = Path(out)
    if out.exists() and not (out / MANIFEST).is_file() and (not out.is_dir() or
                                                            any(out.iterdir())):
        raise UsageError(f"-d {out}: exists and is not a qpcbuild bundle; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    # here, not at the top: `inspect` / `verify` of a local folder come through this module, and
    # bundle.build pulls in the exporter (onnx, numpy) they should not pay for
    from ..bundle.build import publish, remove_debris, staging_folder

    remove_debris(out)
    with staging_folder(out) as staging:
        (staging / MANIFEST).write_bytes(raw)
        try:
            m = read_manifest(staging)
        except (BundleError, UsageError) as exc:
            raise BundleError(f"{where}: its config is not a bundle manifest ({exc})") from None
        problems = changed_fields(m)
        if problems or (oci.get("annotations") or {}).get(f"{ANNOTATION}id") != m["bundle_id"]:
            raise BundleError(f"{where}: the manifest does not hash to its bundle id, or the "
                              "artifact's bundle id annotation differs; refusing it"
                              + (f" ({'; '.join(problems[:3])})" if problems else ""))
        _check_layers(files, m["files"], raw, where)
        download_folder(client, ref.repository,
                        {rel: meta for rel, meta in files.items() if rel != MANIFEST},
                        staging, say)
        publish(staging, out)
    return m["bundle_id"], digest


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


def open_bundle(arg: Path, insecure: bool = False, say: Say | None = None) -> Path:
    """A bundle folder for a command that takes BUNDLE: the folder itself, or, for a registry
    reference, the store's copy (pulled unless a copy of that exact manifest is there)."""
    text = str(arg)
    if Path(arg).exists() or not looks_like_reference(text):
        return Path(arg)
    ref = parse_reference(text, "BUNDLE")
    with RegistryClient(ref.registry, insecure) as client:
        digest = ref.digest or client.get_manifest(ref.repository, ref.pinned)[1]
        folder = store_dir() / digest.replace(":", "-")
        if (folder / MANIFEST).is_file():
            return folder
        (say or (lambda m: None))(f"pulling {ref} into {folder}")
        pull_bundle(Reference(ref.registry, ref.repository, digest=digest), folder, client)
    return folder

"""Artifacts attached to another one (OCI distribution spec 1.1 "referrers"): a small manifest
whose `subject` is the artifact it describes, found again from that artifact's digest.

A registry with the referrers API (`GET /v2/<repo>/referrers/<digest>`) indexes them itself.
One without it (docker-registry 2.8, many private mirrors) gets the spec's tag-schema fallback:
the client keeps an OCI image index of the referrers under the tag `sha256-<hex>` of the
subject, reading, updating and putting it back on each push. That read-modify-write is not
atomic: two pushes of referrers to one subject at the same moment can drop one entry, as the
spec acknowledges; pushing again restores it.
"""

from __future__ import annotations

from .client import OCI_INDEX, OCI_MANIFEST, RegistryClient, encode_manifest, sha256_digest
from .errors import RegistryError, RegistryNotFound

EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_BLOB = b"{}"


def fallback_tag(digest: str) -> str:
    """The tag-schema name of a subject's referrers index: `<algorithm>-<hex>`."""
    algorithm, _, hexdigest = digest.partition(":")
    return f"{algorithm}-{hexdigest}"[:128]


def attach(client: RegistryClient, repo: str, subject: dict, artifact_type: str,
           data: bytes) -> str:
    """Push `data` as a one-layer artifact whose subject is `subject` (a manifest descriptor:
    mediaType, digest, size) and make it findable from the subject's digest. Returns the
    referrer manifest's digest."""
    client.push_blob(repo, sha256_digest(EMPTY_BLOB), len(EMPTY_BLOB), data=EMPTY_BLOB)
    layer = sha256_digest(data)
    client.push_blob(repo, layer, len(data), data=data)
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
                "config": {"mediaType": EMPTY_TYPE, "digest": sha256_digest(EMPTY_BLOB),
                           "size": len(EMPTY_BLOB)},
                "layers": [{"mediaType": artifact_type, "digest": layer, "size": len(data)}],
                "subject": subject}
    encoded = encode_manifest(manifest)
    digest = client.put_manifest(repo, sha256_digest(encoded), manifest)
    if client.referrers_api(repo, subject["digest"]) is None:
        _add_to_fallback_index(client, repo, subject["digest"],
                               {"mediaType": OCI_MANIFEST, "digest": digest,
                                "size": len(encoded), "artifactType": artifact_type})
    return digest


def _add_to_fallback_index(client: RegistryClient, repo: str, subject_digest: str,
                           entry: dict) -> None:
    tag = fallback_tag(subject_digest)
    try:
        index, _ = client.get_manifest(repo, tag, OCI_INDEX)
    except RegistryNotFound:
        index = {}
    kept = [m for m in _entries(index, f"{client.registry}/{repo}:{tag}")
            if m.get("digest") != entry["digest"]]
    client.put_manifest(repo, tag, {"schemaVersion": 2, "mediaType": OCI_INDEX,
                                    "manifests": kept + [entry]}, OCI_INDEX)


def referrers(client: RegistryClient, repo: str, subject_digest: str,
              artifact_type: str) -> list[dict]:
    """Descriptors of the referrers of `subject_digest` with that artifact type: from the
    referrers API, else from the tag-schema index; [] when there are none."""
    index = client.referrers_api(repo, subject_digest)
    tag = fallback_tag(subject_digest)
    if index is None:
        try:
            index, _ = client.get_manifest(repo, tag, OCI_INDEX)
        except RegistryNotFound:
            return []
    return [m for m in _entries(index, f"{client.registry}/{repo}:{tag}")
            if m.get("artifactType") == artifact_type and isinstance(m.get("digest"), str)]


def _entries(index: dict, where: str) -> list[dict]:
    if index == {}:
        return []
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or index.get("mediaType", OCI_INDEX) != OCI_INDEX:
        raise RegistryError(f"{where}: holds something other than an OCI image index of "
                            "referrers; not touching it")
    return [m for m in manifests if isinstance(m, dict)]

"""Which registry failures are worth repeating a request for, and how long to wait."""

from __future__ import annotations

import json

import httpx

# Registries answer 5xx under load (Debian's docker-registry: HTTP 500 on a blob HEAD while
# another client commits the same blob) and 429 when rate limiting. Reads change nothing, so
# they are repeated, as Docker's and ORAS's clients do; uploads are not (a repeated PATCH or PUT
# could land twice), and a failed push is retried by running it again. One PUT is the exception:
# a manifest refused in the registry's own blob-link race (blob_link_race) is sent again.
IDEMPOTENT_READS = frozenset({"GET", "HEAD"})
RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0)
MAX_PAUSE_S = 5.0


def transient(status: int) -> bool:
    return status == 429 or (status >= 500 and status != 501)  # 501: not implemented, for good


def retry_after(resp: httpx.Response, default: float) -> float:
    """The server's Retry-After in seconds when it gives one as a number, else `default`."""
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "")))
    except ValueError:
        return default


def blob_link_race(resp: httpx.Response) -> bool:
    """Is this refused manifest the registry's own race, worth sending again? Two builders
    pushing one cache key to Debian's docker-registry met it in CI: the manifest refused with
    DIGEST_INVALID + MANIFEST_BLOB_UNKNOWN although both had confirmed every blob. The likely
    cause is the registry rewriting a blob's link file in place (truncate, then write) when the
    second client commits the same blob, so a manifest checked in that instant reads an empty
    link. The same bytes under the same tag land once, so the PUT is repeated after a pause;
    any other refusal is final."""
    if resp.status_code != 400:
        return False
    try:
        codes = {e.get("code") for e in json.loads(resp.content).get("errors") or []}
    except (ValueError, AttributeError):
        return False
    return "MANIFEST_BLOB_UNKNOWN" in codes and codes <= {"MANIFEST_BLOB_UNKNOWN", "DIGEST_INVALID"}

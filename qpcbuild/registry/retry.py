"""Which registry failures are worth repeating a request for, and how long to wait."""

from __future__ import annotations

import httpx

# Registries answer 5xx under load (Debian's docker-registry: HTTP 500 on a blob HEAD while
# another client commits the same blob) and 429 when rate limiting. Reads change nothing, so
# they are repeated, as Docker's and ORAS's clients do; uploads are not (a repeated PATCH or PUT
# could land twice), and a failed push is retried by running it again.
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

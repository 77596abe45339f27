"""Blob downloads through the standard library's http.client.

Measured here on a 652 MB layer from the local registry, httpx's streaming reader (64 KiB
socket reads, each through its HTTP parser) delivered 50 MB/s where http.client's `readinto`
into one 4 MiB buffer delivered 106 MB/s, hashing and writing included. Everything else
(manifests, uploads, tokens) stays on httpx; this module only opens a blob for reading, with
the client's credentials, following redirects (without credentials once they leave the
registry's origin, as registries that serve blobs from object storage expect).
"""

from __future__ import annotations

import http.client
import ssl
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol
from urllib.parse import urljoin, urlsplit

from .errors import RegistryError, RegistryUnavailable


class BlobClient(Protocol):
    """What a download needs of the registry client (client.RegistryClient is one): where the
    registry is, its credentials for a scope, answering a 401 challenge, and its errors. A
    protocol, so this module need not import the client that imports it."""
    registry: str
    base: str

    def auth_header(self, scope: str) -> dict[str, str]: ...

    def authenticate(self, challenge: str, scope: str) -> None: ...

    def error(self, status: int, body: bytes, what: str) -> RegistryError: ...


MAX_REDIRECTS = 5


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


def _get(url: str, headers: dict[str, str], timeout: float
         ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    parts = urlsplit(url)
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("GET", path, headers=headers)
        return conn, conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise RegistryUnavailable(f"{parts.hostname} is not reachable ({exc or type(exc)})") \
            from None


@contextmanager
def open_blob(client: BlobClient, repo: str, digest: str, headers: dict[str, str],
              what: str, timeout: float = 60.0) -> Iterator[http.client.HTTPResponse]:
    """A 200 or 206 response with the blob's bytes to read; any other answer is raised as the
    client's error of the right kind."""
    scope = f"repository:{repo}:pull"
    url = f"{client.base}/v2/{repo}/blobs/{digest}"
    auth, authenticated = client.auth_header(scope), False
    for _ in range(MAX_REDIRECTS + 2):
        conn, resp = _get(url, {**headers, **auth}, timeout)
        try:
            try:
                if resp.status in (200, 206):
                    pass
                elif resp.status == 401 and not authenticated:
                    challenge = resp.getheader("WWW-Authenticate", "")
                    resp.read()
                    client.authenticate(challenge, scope)
                    auth, authenticated = client.auth_header(scope), True
                    continue
                elif resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                    target = urljoin(url, resp.getheader("Location"))
                    resp.read()
                    if _origin(target) != _origin(url):
                        auth = {}  # credentials stay with the registry
                    url = target
                    continue
                else:
                    raise client.error(resp.status, resp.read(64 << 10), f"downloading {what}")
            except (OSError, http.client.HTTPException) as exc:
                raise RegistryUnavailable(f"registry {client.registry}: downloading {what} "
                                          f"failed ({exc or type(exc).__name__})") from None
            yield resp
            return
        finally:
            conn.close()
    raise RegistryUnavailable(f"registry {client.registry}: too many redirects for {what}")


def read_pieces(resp: http.client.HTTPResponse, registry: str,
                buffers: Callable[[], memoryview]) -> Iterator[memoryview]:
    """The body in pieces, each read into a buffer that `buffers` lends (writer.py's
    BackgroundWriter.buffer: a few buffers taking turns)."""
    while True:
        buffer = buffers()
        try:
            n = resp.readinto(buffer)
        except (OSError, http.client.HTTPException) as exc:
            raise RegistryUnavailable(f"registry {registry}: the download broke off "
                                      f"({exc or type(exc).__name__})") from None
        if not n:
            if resp.length:  # closed before Content-Length bytes came (readinto does not raise)
                raise RegistryUnavailable(f"registry {registry}: the connection closed "
                                          f"{resp.length:,} bytes before the end")
            return
        yield buffer[:n]

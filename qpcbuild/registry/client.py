"""A small OCI distribution client on httpx: just what bundles and cache entries need.

Our own, not the `oras` SDK (docs/registry.md says why): every blob streams in bounded pieces
(memory stays flat for multi-GB layers), its SHA-256 is computed while the bytes arrive, a
broken download continues from the last byte received (HTTP Range) and a broken upload from
the last byte the registry confirms (the upload session's Range), and tokens, Basic auth and
transport choice follow the distribution spec and Docker's conventions.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urljoin

import httpx

from .auth import Authentication
from .credentials import Credentials
from .documents import (MAX_ERROR_BYTES, MAX_MANIFEST_BYTES, ImageIndex, ImageManifest, as_dict,
                        parse, read_bounded)
from .errors import (RegistryAuthError, RegistryDigestMismatch, RegistryError, RegistryNotFound,
                     RegistryUnavailable, transport_error)
from .rawget import open_blob, read_pieces
from .reference import is_loopback
from .retry import (IDEMPOTENT_READS, MAX_PAUSE_S, RETRY_DELAYS_S, blob_link_race, retry_after,
                    transient)
from .writer import BackgroundWriter

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
UPLOAD_CHUNK = 128 << 20  # one PATCH per chunk: a broken upload repeats at most this much
READ_PIECE = 4 << 20
MAX_SMALL_BLOB = 64 << 20  # manifests and config blobs read into memory
RETRIES = 3


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def encode_manifest(manifest: dict) -> bytes:
    """The exact bytes put_manifest sends (a descriptor of it needs their size)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def _file_piece(path: Path, offset: int, length: int,
                advance: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """The bytes of a file's range, piece by piece; `advance` hears of each piece as it goes
    (a piece sent again after a broken connection is counted again: bytes sent)."""
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            piece = f.read(min(READ_PIECE, length))
            if not piece:
                raise RegistryError(f"{path}: shorter than expected while uploading (changed?)")
            length -= len(piece)
            if advance:
                advance(len(piece))
            yield piece


class RegistryClient(Authentication):
    """One registry (host[:port]); every call names its repository."""

    retry_delays: tuple[float, ...] = RETRY_DELAYS_S  # pauses before each repeat (retry.py)

    def __init__(self, registry: str, insecure: bool = False,
                 credentials: Credentials | None = None, timeout: float = 60.0):
        self.registry = registry
        scheme = "http" if insecure or is_loopback(registry) else "https"
        self.base = f"{scheme}://{registry}"
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0),
                                 follow_redirects=True)  # httpx drops Authorization off-origin
        self.start_auth(credentials)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "RegistryClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ requests
    def _send(self, method: str, url: str, repo: str, push: bool = False,
              body: Callable[[], object] | None = None, headers: dict | None = None,
              stream: bool = False, also: str = "") -> httpx.Response:
        """One request, authenticated on demand (a 401 is answered once, then the request
        repeats; `body` makes a fresh body for that repeat). A read (GET, HEAD) answered with
        a transient error status is repeated after a pause (registry/retry.py); a registry that
        cannot be reached fails at once, so a remote cache falls back without waiting. Transport failures
        become RegistryUnavailable; HTTP errors are the caller's to read. `also`: a scope the
        request needs besides its own repository's (a mount's source)."""
        delays = iter(self.retry_delays if method in IDEMPOTENT_READS else ())
        while True:
            resp = self._send_once(method, url, repo, push, body, headers, stream, also)
            pause = next(delays, None) if transient(resp.status_code) else None
            if pause is None:
                return resp
            resp.close()
            time.sleep(min(retry_after(resp, pause), MAX_PAUSE_S))

    def _send_once(self, method: str, url: str, repo: str, push: bool,
                   body: Callable[[], object] | None, headers: dict | None,
                   stream: bool, also: str) -> httpx.Response:
        scope = f"repository:{repo}:{'pull,push' if push else 'pull'} {also}".strip()
        url = urljoin(self.base + "/", url)
        for attempt in (0, 1):
            request = self.http.build_request(
                method, url, headers={**(headers or {}), **self.auth_header(scope)},
                content=body() if body else None)
            try:
                resp = self.http.send(request, stream=stream)
            except httpx.HTTPError as exc:
                raise transport_error(self.registry, exc) from None
            if resp.status_code != 401:
                return resp
            resp.close()
            if attempt == 1:
                raise RegistryAuthError(f"registry {self.registry} refused access to {repo} "
                                        f"{self._who()}")
            self.authenticate(resp.headers.get("WWW-Authenticate", ""), scope)
        raise AssertionError("unreachable")

    def _fail(self, resp: httpx.Response, what: str) -> RegistryError:
        if resp.is_stream_consumed:
            return self.error(resp.status_code, resp.content, what)
        # only the start of an error body is shown, so only that much is read
        body = bytearray()
        try:
            for piece in resp.iter_bytes():
                body += piece
                if len(body) >= MAX_ERROR_BYTES:
                    break
        except httpx.HTTPError:
            pass  # the status alone still says what went wrong
        finally:
            resp.close()
        return self.error(resp.status_code, bytes(body), what)

    def _small_body(self, resp: httpx.Response, what: str) -> bytes:
        """A streamed response's body, at most MAX_MANIFEST_BYTES of it."""
        try:
            return read_bounded(resp.iter_bytes(), MAX_MANIFEST_BYTES, what)
        except httpx.HTTPError as exc:
            raise transport_error(self.registry, exc) from None
        finally:
            resp.close()

    def error(self, status: int, body: bytes, what: str) -> RegistryError:
        """The registry's own error message, in an error of the right kind."""
        try:
            errors = json.loads(body).get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
        except (ValueError, AttributeError, TypeError, RecursionError):
            detail = body[:200].decode(errors="replace")
        message = f"{what}: registry {self.registry} answered HTTP {status}" + \
            (f" ({detail})" if detail else "")
        if status == 404:
            return RegistryNotFound(message)
        if status == 403:
            return RegistryAuthError(message + f"; access denied {self._who()}")
        if status >= 500 or status == 429:
            return RegistryUnavailable(message)
        return RegistryError(message)

    def ping(self) -> None:
        """Is the registry there and does it speak the v2 API (credentials checked lazily)?"""
        try:
            resp = self.http.get(f"{self.base}/v2/")
        except httpx.HTTPError as exc:
            raise transport_error(self.registry, exc) from None
        if resp.status_code not in (200, 401):
            raise self._fail(resp, "GET /v2/")

    # ------------------------------------------------------------ manifests
    def get_manifest(self, repo: str, reference: str,
                     media_type: str = OCI_MANIFEST) -> tuple[dict, str]:
        """(manifest, its digest). A manifest asked for by digest must hash to that digest."""
        what = f"{self.registry}/{repo}:{reference}"
        resp = self._send("GET", f"/v2/{repo}/manifests/{reference}", repo,
                          headers={"Accept": media_type}, stream=True)
        if resp.status_code != 200:
            raise self._fail(resp, what)
        data = self._small_body(resp, f"the manifest of {what}")
        digest = sha256_digest(data)
        if reference.startswith("sha256:") and digest != reference:
            raise RegistryError(f"{self.registry}/{repo}@{reference}: the manifest the registry "
                                f"sent hashes to {digest}; refusing it")
        model = ImageIndex if media_type == OCI_INDEX else ImageManifest
        return as_dict(parse(data, model, f"the manifest of {what}")), digest

    def put_manifest(self, repo: str, tag: str, manifest: dict,
                     media_type: str = OCI_MANIFEST) -> str:
        """Store a manifest under a tag (or under its own digest); returns its digest."""
        data = encode_manifest(manifest)
        pauses = iter(self.retry_delays)
        while True:
            resp = self._send("PUT", f"/v2/{repo}/manifests/{tag}", repo, push=True,
                              body=lambda: data, headers={"Content-Type": media_type})
            if resp.status_code == 201:
                return sha256_digest(data)
            error = self._fail(resp, f"pushing the manifest of {self.registry}/{repo}:{tag}")
            pause = next(pauses, None) if blob_link_race(resp) else None
            if pause is None:
                raise error
            time.sleep(pause)

    def referrers_api(self, repo: str, digest: str) -> dict | None:
        """The registry's referrers index for `digest` (OCI distribution 1.1), or None when the
        registry has no referrers API (404): the caller then reads the tag-schema index."""
        what = f"referrers of {self.registry}/{repo}@{digest}"
        resp = self._send("GET", f"/v2/{repo}/referrers/{digest}", repo,
                          headers={"Accept": OCI_INDEX}, stream=True)
        if resp.status_code == 404:
            resp.close()
            return None
        if resp.status_code != 200:
            raise self._fail(resp, what)
        return as_dict(parse(self._small_body(resp, what), ImageIndex, what))

    # ------------------------------------------------------------ blobs
    def has_blob(self, repo: str, digest: str) -> bool:
        resp = self._send("HEAD", f"/v2/{repo}/blobs/{digest}", repo, push=True)
        if resp.status_code == 200:
            return True
        if resp.status_code == 404:
            return False
        raise self._fail(resp, f"checking blob {digest}")

    def push_blob(self, repo: str, digest: str, size: int, path: Path | None = None,
                  data: bytes | None = None,
                  advance: Callable[[int], None] | None = None) -> bool:
        """Upload a blob unless the repository has it already; True when bytes were sent.
        A blob up to UPLOAD_CHUNK goes in one streamed request, sent again whole if the
        connection breaks; a larger one in UPLOAD_CHUNK pieces, a broken piece resent from the
        offset the registry confirms."""
        if self.has_blob(repo, digest):
            return False
        body = (lambda: data) if data is not None else \
            (lambda: _file_piece(path, 0, size, advance))
        for failures in range(RETRIES + 1):
            location = self._start_upload(repo, digest)
            if data is None and size > UPLOAD_CHUNK:
                return self._upload_chunks(repo, location, digest, size, path, advance)
            try:
                return self._finish_upload(repo, location, digest, body, size)
            except RegistryUnavailable:
                if failures == RETRIES:
                    raise
        raise AssertionError("unreachable")

    def mount_blob(self, repo: str, digest: str, from_repo: str) -> bool:
        """Add a blob the registry holds in `from_repo` to `repo` without moving bytes; False
        when it will not: it opened an ordinary upload instead (cancelled here), or it refused
        us the mount (a token service that grants pull on `from_repo` to this identity only
        in another token, or not at all). The caller then uploads the bytes."""
        try:
            resp = self._send("POST", f"/v2/{repo}/blobs/uploads/?mount={digest}&from={from_repo}",
                              repo, push=True, also=f"repository:{from_repo}:pull")
        except RegistryAuthError:
            return False
        if resp.status_code == 202 and resp.headers.get("Location"):
            self._send("DELETE", resp.headers["Location"], repo, push=True).close()
        elif resp.status_code != 201:
            raise self._fail(resp, f"mounting {digest} from {from_repo}")
        return resp.status_code == 201

    def _start_upload(self, repo: str, digest: str) -> str:
        resp = self._send("POST", f"/v2/{repo}/blobs/uploads/", repo, push=True)
        if resp.status_code != 202:
            raise self._fail(resp, f"starting the upload of {digest}")
        return resp.headers["Location"]

    def _upload_chunks(self, repo: str, location: str, digest: str, size: int, path: Path,
                       advance: Callable[[int], None] | None = None) -> bool:
        offset, failures = 0, 0
        while offset < size:
            length = min(UPLOAD_CHUNK, size - offset)
            try:
                resp = self._send("PATCH", location, repo, push=True,
                                  body=lambda o=offset, n=length: _file_piece(path, o, n,
                                                                              advance),
                                  headers={"Content-Type": "application/octet-stream",
                                           "Content-Length": str(length),
                                           "Content-Range": f"{offset}-{offset + length - 1}"})
            except RegistryUnavailable:
                failures += 1
                if failures > RETRIES:
                    raise
                offset = self._confirmed_offset(repo, location)
                continue
            if resp.status_code != 202:
                raise self._fail(resp, f"uploading {path}")
            location = resp.headers["Location"]
            offset = int(resp.headers["Range"].rsplit("-", 1)[1]) + 1
        return self._finish_upload(repo, location, digest, lambda: b"", 0)

    def _confirmed_offset(self, repo: str, location: str) -> int:
        resp = self._send("GET", location, repo, push=True)
        if resp.status_code != 204:
            raise self._fail(resp, "resuming an upload")
        return int(resp.headers.get("Range", "0--1").rsplit("-", 1)[1]) + 1

    def _finish_upload(self, repo: str, location: str, digest: str,
                       body: Callable[[], object], length: int) -> bool:
        url = location + ("&" if "?" in location else "?") + f"digest={digest}"
        resp = self._send("PUT", url, repo, push=True, body=body,
                          headers={"Content-Type": "application/octet-stream",
                                   "Content-Length": str(length)})
        if resp.status_code != 201:
            error = self._fail(resp, f"finishing the upload of {digest}")
            if "DIGEST_INVALID" in str(error):
                raise RegistryDigestMismatch(str(error))
            raise error
        return True

    def read_blob(self, repo: str, digest: str, limit: int = MAX_SMALL_BLOB) -> bytes:
        """A small blob (a config) in memory, its digest checked."""
        resp = self._send("GET", f"/v2/{repo}/blobs/{digest}", repo, stream=True)
        try:
            if resp.status_code != 200:
                raise self._fail(resp, f"blob {digest}")
            data = b""
            for piece in resp.iter_raw():
                data += piece
                if len(data) > limit:
                    raise RegistryError(f"blob {digest} is larger than {limit} bytes")
        except httpx.HTTPError as exc:
            raise transport_error(self.registry, exc) from None
        finally:
            resp.close()
        if sha256_digest(data) != digest:
            raise RegistryError(f"blob {digest} from {self.registry}/{repo} does not match its "
                                "digest (damaged in the registry or in transit); refusing it")
        return data

    def download_blob(self, repo: str, digest: str, size: int, dest: Path,
                      what: str = "", advance: Callable[[int], None] | None = None,
                      resume: bool = False) -> int:
        """Stream a blob into `dest`, hashing as it arrives; a broken transfer continues from
        the last byte written. `resume`: `dest` holds the blob's first bytes (an interrupted
        pull's), hashed again here, and the rest is asked for from there. Raises when the
        bytes do not match `digest` and `size`. Returns the bytes received."""
        h, written = hashlib.sha256(), 0
        with open(dest, "r+b" if resume else "wb") as out:
            while resume and (piece := out.read(READ_PIECE)):  # leaves the file at its end
                h.update(piece)
                written += len(piece)
            prefix = written
            if advance and prefix:
                advance(prefix)
            with BackgroundWriter(out) as writer:
                h = self._receive(repo, digest, size, out, writer, h, written, what, advance)
                writer.flush()
            written = out.tell()
        if written != size or "sha256:" + h.hexdigest() != digest:
            raise RegistryDigestMismatch(
                f"{what or digest}: the bytes from {self.registry}/{repo} do not match the "
                f"layer's digest {digest} (got {written} bytes of {size}); the blob is damaged "
                "in the registry or in transit")
        return written - prefix

    def _receive(self, repo: str, digest: str, size: int, out, writer: BackgroundWriter,
                 h, written: int, what: str, advance: Callable[[int], None] | None):
        """The blob's bytes from `written` on, into `out` through `writer`, hashed on top of
        `h` (the bytes before). Returns the hash of everything in `out`."""
        failures = 0
        while True:
            headers = {"Range": f"bytes={written}-"} if written else {}
            try:
                with open_blob(self, repo, digest, headers, what or digest) as resp:
                    if written and resp.status == 200:  # no range support: restart
                        writer.flush()
                        out.seek(0)
                        out.truncate()
                        h, written = hashlib.sha256(), 0
                    for piece in read_pieces(resp, self.registry, writer.buffer):
                        h.update(piece)  # here, while the writer thread writes the last
                        writer.write(piece)
                        written += len(piece)
                        if advance:
                            advance(len(piece))
                        if written > size:
                            break
                return h
            except RegistryUnavailable:
                failures += 1
                if failures > RETRIES:
                    raise

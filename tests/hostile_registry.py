"""A registry that answers what a test tells it to: a fixed body (or an endless one) for each
manifest, referrers index and token request, on a free loopback port, in a thread of the test
process. For the malformed and hostile answers a real registry never gives (tests/
registry_server.py runs the real one)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator

ENDLESS_CAP = 64 << 20  # an "endless" body stops here, so a client that reads it all ends too


def endless(prefix: bytes = b'{"schemaVersion": 2, "x": "') -> Iterator[bytes]:
    """A JSON document that never closes, in 64 kB pieces, up to ENDLESS_CAP bytes."""
    yield prefix
    piece, sent = b"x" * (64 << 10), len(prefix)
    while sent < ENDLESS_CAP:
        yield piece
        sent += len(piece)


class HostileRegistry:
    """`manifests[reference]` / `referrers[digest]`: the body (bytes, or a function giving the
    pieces of one sent without a length, such as `endless`) for GET
    /v2/<repo>/manifests/<reference> and /v2/<repo>/referrers/<digest>. With `token` set,
    every /v2/<repo>/... request without a bearer token is answered 401 with a challenge
    whose realm answers `token`."""

    def __init__(self) -> None:
        self.manifests: dict[str, bytes | Callable[[], Iterator[bytes]]] = {}
        self.referrers: dict[str, bytes | Callable[[], Iterator[bytes]]] = {}
        self.token: bytes | Callable[[], Iterator[bytes]] | None = None
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        registry = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/token":
                    return self._answer(200, registry.token)
                if path == "/v2/":
                    return self._answer(200, b"{}")
                if registry.token is not None and \
                        not self.headers.get("Authorization", "").startswith("Bearer "):
                    realm = f"http://{registry.address}/token"
                    return self._answer(401, b"{}", {"WWW-Authenticate": f'Bearer realm="{realm}"'
                                                     f',service="hostile"'})
                parts = path.split("/")
                table = {"manifests": registry.manifests, "referrers": registry.referrers}
                body = table.get(parts[-2], {}).get(parts[-1]) if len(parts) > 3 else None
                if body is None:
                    return self._answer(404, b'{"errors": [{"code": "NOT_FOUND"}]}')
                self._answer(200, body)

            def _answer(self, status: int, body, headers: dict | None = None) -> None:
                body = body() if callable(body) else body  # a fresh endless body each time
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                try:
                    if isinstance(body, bytes):
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        return
                    self.send_header("Connection", "close")  # no length: the body ends at close
                    self.end_headers()
                    for piece in body:
                        self.wfile.write(piece)
                    self.close_connection = True
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client stopped reading: as it should

            def log_message(self, *args) -> None:  # quiet: pytest shows failures, not traffic
                pass

        return Handler

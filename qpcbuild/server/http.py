"""The HTTP server's own limits, which uvicorn leaves open: a client that sends half a request
head is disconnected after HEADER_TIMEOUT (uvicorn waits forever), and a shutdown (SIGTERM,
Ctrl-C) gives running requests SHUTDOWN_GRACE seconds before cancelling them (uvicorn waits
for every connection, so one stalled client kept the server alive)."""

from __future__ import annotations

import errno
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import QpcbuildError

HEADER_TIMEOUT = 10.0  # seconds from connection (or the last response) to a complete request head
SHUTDOWN_GRACE = 10.0  # seconds running requests may take to finish once a shutdown begins


class PortBusyError(QpcbuildError):
    """The address to listen on is taken or not ours to use. Exit code 1 (an environment
    problem, not a bad argument)."""


class _TimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every request head."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def _await_head(self) -> None:
        self.loop.call_later(HEADER_TIMEOUT, self._head_late, self.cycle)

    def _head_late(self, cycle_then) -> None:
        # A new request replaces self.cycle once its head is complete; the same cycle means none
        # arrived (an idle keep-alive connection is closed by then too).
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be used ({exc.strerror})"
        raise PortBusyError(f"{host}:{port} {why}; pick another --port or --host") from None
    sock.set_inheritable(True)
    return sock


def run_until_signalled(app, sock: socket.socket, log_level: str) -> None:
    config = uvicorn.Config(app, log_level=log_level, access_log=False, http=_TimedH11,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE)
    uvicorn.Server(config).run(sockets=[sock])

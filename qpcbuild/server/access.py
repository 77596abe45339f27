"""What `qpcbuild serve` writes to its log, as `vllm serve` does: one line per request (method,
the client's route, status, tokens, time) and, every few seconds while there is work, the
throughput, the queue and the draft acceptance. `--quiet` turns both off."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from .metrics import ServerMetrics
    from .worker import EngineWorker


@dataclass
class ServerLog:
    """Where and how much the server says. `stats_interval` 0: no throughput lines."""

    requests: bool = True
    stats_interval: float = 10.0
    out: TextIO | None = None  # default: stderr at the time of writing (tests swap it)

    def say(self, line: str) -> None:
        out = self.out or sys.stderr
        out.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        out.flush()

    def request(self, method: str, route: str, status: int, tokens: tuple[int, int] | None,
                seconds: float) -> None:
        if not self.requests:
            return
        used = f", {tokens[0]} prompt + {tokens[1]} generated tokens" if tokens else ""
        self.say(f"{method} {route} {status}{used}, {seconds:.3f} s")

    async def report(self, worker: EngineWorker, metrics: ServerMetrics) -> None:
        """Throughput since the last line, every stats_interval seconds while anything ran."""
        if self.stats_interval <= 0:
            return
        last = (time.perf_counter(), worker.prompt_tokens, worker.generated_tokens)
        while True:
            await asyncio.sleep(self.stats_interval)
            now = (time.perf_counter(), worker.prompt_tokens, worker.generated_tokens)
            running, waiting = worker.running, worker.waiting
            if now[1:] == last[1:] and not running and not waiting:
                last = now
                continue  # an idle server keeps its log quiet
            span = now[0] - last[0]
            line = (f"throughput: prompt {(now[1] - last[1]) / span:.1f} tokens/s, generation "
                    f"{(now[2] - last[2]) / span:.1f} tokens/s; {running} running, "
                    f"{waiting} waiting")
            rate, length = metrics.acceptance()
            if rate is not None:
                line += (f"; draft acceptance {100 * rate:.1f}%, mean acceptance length "
                         f"{length:.2f} (finished requests since start)")
            self.say(line)
            last = now


class RequestLog:
    """ASGI middleware: one line per HTTP request once its response is complete. Handlers put
    the request's (prompt, generated) token counts in `request.state.tokens`."""

    def __init__(self, app, log: ServerLog):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.log.requests:
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [499]  # no response: the client left
        state = scope.setdefault("state", {})

        async def send_noting_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            route = scope.get("raw_path", b"").decode("latin-1") or scope.get("path", "")
            self.log.request(scope["method"], route[:200], status[0], state.get("tokens"),
                             time.perf_counter() - start)


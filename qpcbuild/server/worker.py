"""One engine thread shared by every request.

ONNX Runtime calls block, so the decoding loop runs in its own thread and talks to the asyncio
server through a queue (requests in) and thread-safe callbacks (tokens out). With KV slots
(`shapes.full_batch_size`) the loop is continuous: whenever a slot frees, the next waiting
request is prefilled into it while the others keep decoding. Without them, requests run in
groups of the compiled batch size, in arrival order.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..runtime.rows import Row, new_row
from ..runtime.loader import Generator
from ..runtime.sampling import SamplingParams

log = logging.getLogger("qpcbuild.server")

# (job, new token ids, finished) -> None; called on the engine thread
Listener = Callable[["Job", list[int], bool], None]


@dataclass
class Job:
    row: Row
    listener: Listener
    finished: bool = False
    taken: bool = False  # handed to the engine
    error: str | None = None
    tokens: list[int] = field(default_factory=list)  # generated so far

    def cancel(self, reason: str = "abort") -> None:
        """Free the request's slot at the engine's next step: "abort" when the client is gone,
        "stop" when a stop string ended the text."""
        if not self.row.cancelled:
            self.row.cancelled = reason


class EngineWorker:
    def __init__(self, gen: Generator, on_finish: Callable[[Job], None] | None = None):
        self.gen, self.on_finish = gen, on_finish
        self.decoder = gen.decoder
        self.slots = self.decoder.batch
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # Totals since start, counted as the engine goes (the log's throughput lines).
        self.prompt_tokens = self.generated_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="qpcbuild-engine", daemon=True)
        self._thread.start()

    def _live(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    @property
    def running(self) -> int:
        return sum(1 for j in self._live() if j.taken)

    @property
    def waiting(self) -> int:
        return sum(1 for j in self._live() if not j.taken)

    def submit(self, prompt: list[int], max_new_tokens: int, sp: SamplingParams,
               listener: Listener) -> Job:
        with self._lock:
            index = next(self._ids)
        # Each request's generator is seeded as `run` seeds a single prompt (index 0).
        row = new_row(prompt, max_new_tokens, self.decoder.ctx_len, sp, 0)
        row.index = index
        job = Job(row, listener)
        with self._lock:
            self._jobs[index] = job
        self._queue.put(job)
        return job

    def close(self) -> None:
        for job in self._live():  # shutting down: requests still running end now
            job.cancel()
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------ the engine thread
    def _take(self, n: int, block: bool) -> list[Job]:
        jobs = []
        while len(jobs) < n:
            try:
                job = self._queue.get(block=block and not jobs)
            except queue.Empty:
                break
            if job is None:
                self._closing = True
                break
            if job.row.cancelled:  # gone before it started
                job.row.done, job.row.finish_reason = True, job.row.cancelled
                self._finish(job)
                continue
            job.taken = True
            self.prompt_tokens += len(job.row.prompt)
            jobs.append(job)
        return jobs

    def _loop(self) -> None:
        self._closing = False
        while not self._closing:
            jobs = self._take(self.slots, block=True)
            if not jobs:
                continue

            def incoming(n: int) -> list[Row]:  # continuous batching refills freed slots
                return [j.row for j in self._take(n, block=False)]
            try:
                self.decoder.run_rows([j.row for j in jobs], on_token=self._on_token,
                                      incoming=incoming if self.decoder.cb else None)
            except Exception as exc:  # a failing model call must not kill the server
                log.exception("engine step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
            for job in self._live():  # rows that ended without a callback
                if job.taken and not job.finished:
                    self._finish(job)

    def _on_token(self, index: int, ids: list[int]) -> None:
        job = self._jobs.get(index)
        if job is None:
            return
        job.tokens.extend(ids)
        self.generated_tokens += len(ids)
        if job.row.done:  # counted before the client hears of the end, so /metrics agrees
            self._finish(job, notify=False)
        job.listener(job, ids, job.row.done)

    def _finish(self, job: Job, notify: bool = True) -> None:
        if job.finished:
            return
        job.finished = True
        if job.row.unavailable and job.error is None:  # ended unserved (the server says 503)
            job.error = job.row.unavailable
        with self._lock:
            self._jobs.pop(job.row.index, None)
        if notify:
            job.listener(job, [], True)
        if self.on_finish:
            self.on_finish(job)

    def _fail_all(self, message: str) -> None:
        for job in self._live():
            if job.taken and not job.finished:
                job.error = message
                job.row.done = True
                self._finish(job)

"""A disaggregated bundle run as two processes (docs/disaggregated.md): a prefill worker that
holds the prefill unit and computes each prompt's KV cache, and this process, the decode node,
which holds the decode target and the draft and speculates.

The hand-off follows the manifest's contract (bundle/handoff.py): the worker prefills the
prompt but its last token, and for each layer's key and value buffer the [1, kv_heads, n,
head_dim] slice of the request's slot crosses the process boundary through one shared-memory
block this process owns; the decode side writes the slices into the request's KV slot and runs
the last prompt token itself, which gives the first output token. The ONNX Runtime artifacts
only: a card's KV never leaves its device (vllm-qaic's QaicConnector moves it there)."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import numpy as np

from ..errors import BundleError, QpcbuildError
from .engine import SpecDecoder
from .model_session import ModelSession
from .rows import LoopTimes, Row
from .session import OrtSession

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest

START_TIMEOUT_S = 300.0  # loading the prefill unit's weights
# A prefill that has not answered in this long is a hung worker: it is killed and replaced
# (`serve --prefill-timeout`); generous, as a long prompt on a busy host takes seconds.
REPLY_TIMEOUT_S = 120.0


@dataclass
class HandoffRecord:
    """One request's hand-off: the KV bytes that crossed, the worker's prefill seconds and the
    seconds the crossing added (round trip less the worker's compute)."""
    prompt_tokens: int
    tokens: int  # positions handed off (the prompt but its last token)
    bytes: int
    prefill_s: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "bytes": self.bytes,
                "prefill_s": round(self.prefill_s, 6), "seconds": round(self.seconds, 6)}


@dataclass
class HandoffLog:
    records: list[HandoffRecord] = field(default_factory=list)
    keep: bool = True  # a server counts each record (on_record) and keeps none
    on_record: Callable[[HandoffRecord], None] | None = None

    def add(self, record: HandoffRecord) -> None:
        if self.keep:
            self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    def to_dict(self) -> dict[str, Any]:
        return {"per_prompt": [r.to_dict() for r in self.records],
                "bytes": sum(r.bytes for r in self.records),
                "seconds": round(sum(r.seconds for r in self.records), 6),
                "prefill_s": round(sum(r.prefill_s for r in self.records), 6),
                "processes": 2, "transport": "shared_memory"}


def _kv_side(session: OrtSession) -> list[np.ndarray]:
    """The KV buffers a session's next call reads (ping-pong sessions alternate two sets)."""
    bufs = session.kv_buffers
    side: list[np.ndarray] = bufs[session._parity % len(bufs)] if len(bufs) > 1 else bufs[0]
    return side


def _worker(bundle: str, shm_name: str) -> None:
    """The prefill process (`python -m qpcbuild.runtime.disagg BUNDLE SHM`): open the prefill
    unit, then answer requests, one JSON line each way on stdin/stdout, until stdin closes."""
    from ..backend_api import DEFAULT_BACKEND, backend_module
    from ..bundle.manifest import SealedManifest

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol

    def send(*msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")

    shm = shared_memory.SharedMemory(name=shm_name)
    # The parent owns the block: this process's resource tracker must not unlink it at exit
    # (Python < 3.13 registers every attach; 3.13's track=False says the same)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        folder = Path(bundle)
        manifest = SealedManifest(folder).checked()  # (the parent verified the files)
        # (the prefill unit runs here on the host's backend only: Generator checks it)
        entry = manifest.roles["prefill"].backends[DEFAULT_BACKEND]
        session = backend_module(DEFAULT_BACKEND, "session").open_session(
            folder, manifest, "prefill", entry)
        shapes = manifest.shapes
        prefiller = SpecDecoder(session, None, None, manifest.ks, shapes.prefill_seq_len, set(),
                                "prefill", bool(shapes.full_batch_size),
                                prefill_tails=tuple(shapes.prefill_tail_seq_lens))
        send("ready", None)
    except Exception as exc:  # the parent reports it
        send("error", f"{type(exc).__name__}: {exc}")
        shm.close()
        return
    for line in sys.stdin:
        heads: list[list[int]] = json.loads(line)
        t0 = time.perf_counter()
        # one row at a time in slot 0 with continuous batching; together as a static batch
        groups = [[h] for h in heads] if prefiller.cb else [heads]
        offset, sizes = 0, []
        for group in groups:
            prefiller._prefill(session, [Row(h, len(h)) for h in group], LoopTimes(), "target",
                               0 if prefiller.cb else None)
            side = _kv_side(session)
            for i, head in enumerate(group):
                row = 0 if prefiller.cb else i
                for buf in side:
                    piece = buf[row, :, :len(head), :]
                    np.ndarray(piece.shape, np.float32, shm.buf, offset)[...] = piece
                    offset += piece.nbytes
                sizes.append(len(head))
        send("done", [sizes, time.perf_counter() - t0])
    shm.close()


class WorkerExited(QpcbuildError):
    """The prefill process is gone (killed, crashed, or killed here when it hung): a new one
    may take over."""


class PrefillUnavailable(QpcbuildError):
    """No prefill worker can answer now: one is being started in place of a dead or hung one
    (the request may be retried shortly), or none could be started. A server answers 503."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry  # False: the worker could not be started again


WorkerState = Literal["ready", "restarting", "failed"]


class PrefillWorker:
    """The prefill process and the shared memory its KV slices cross by. A prefill keeps no
    state between requests, so a worker that dies, or hangs past `reply_timeout_s` (it is then
    killed), is simply replaced. Under `run` the replacement starts at once and the request is
    asked again. A server (`serving`) instead replaces it in the background and answers the
    requests that need it meanwhile with PrefillUnavailable (HTTP 503), never waiting on it;
    one that cannot be started again leaves the worker `failed`, which the server reports."""

    def __init__(self, bundle: Path, manifest: Manifest,
                 reply_timeout_s: float = REPLY_TIMEOUT_S):
        arch, shapes = manifest.target.arch, manifest.shapes
        self.bundle = bundle
        self.buffers = 2 * arch.num_layers
        self.kv_heads, self.head_dim = arch.num_kv_heads, arch.head_dim
        row_bytes = self.buffers * arch.num_kv_heads * shapes.ctx_len * arch.head_dim * 4
        rows = shapes.batch_size if not shapes.full_batch_size else 1
        self.shm = shared_memory.SharedMemory(create=True, size=row_bytes * rows)
        self.restarts = 0
        self.reply_timeout_s = reply_timeout_s
        self.serving = False  # set by a server: replace in the background, never wait
        self.state: WorkerState = "ready"
        self.why = ""  # what ended the last worker, or why none could start
        self._state_lock = threading.Lock()
        self._live: dict[str, subprocess.Popen[str]] = {}  # "proc": the running worker
        self._finalizer = weakref.finalize(self, _shutdown, self._live, self.shm)
        self._start()

    @property
    def proc(self) -> subprocess.Popen[str]:
        return self._live["proc"]

    def _start(self) -> None:
        # A fresh interpreter running this module (not multiprocessing's spawn, which would
        # import the caller's __main__ again): no ORT thread pools forked, no script re-run.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
        self._live["proc"] = subprocess.Popen(
            [sys.executable, "-m", "qpcbuild.runtime.disagg", str(self.bundle),
             self.shm.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        status, detail = self._receive(START_TIMEOUT_S)
        if status != "ready":
            self.close()
            raise BundleError(f"{self.bundle}: the prefill worker could not open the prefill "
                              f"unit: {detail}")

    def _receive(self, timeout: float) -> tuple[str, Any]:
        assert self.proc.stdout is not None
        # a selector, not select.select: a process with over 1,024 open files (a long-lived
        # server, a test session) gets descriptors select() refuses
        with selectors.DefaultSelector() as waiting:
            waiting.register(self.proc.stdout, selectors.EVENT_READ)
            ready = waiting.select(timeout)
        if not ready:
            self.proc.kill()  # hung: it is replaced like a dead one
            raise WorkerExited(f"the prefill worker gave no answer in {timeout:g} s and was "
                               "killed")
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerExited(f"the prefill worker exited (exit code {self.proc.wait()})")
        status, detail = json.loads(line)
        return status, detail

    def _ask(self, heads: list[list[int]]) -> tuple[str, Any]:
        assert self.proc.stdin is not None
        if self.proc.poll() is not None:
            raise WorkerExited(f"the prefill worker is not running (exit code "
                               f"{self.proc.returncode})")
        try:
            self.proc.stdin.write(json.dumps(heads) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerExited(f"the prefill worker is not reachable ({exc})") from None
        return self._receive(self.reply_timeout_s)

    def unavailable(self) -> PrefillUnavailable | None:
        """Why a request cannot be prefilled now (None: it can). A worker found dead here is
        replaced in the background (serving) before anything is asked of it."""
        with self._state_lock:
            if self.state == "ready" and self.serving and self.proc.poll() is not None:
                self._replace_locked(f"the prefill worker exited (exit code "
                                     f"{self.proc.returncode})")
            if self.state == "restarting":
                return PrefillUnavailable(f"{self.why}; a new prefill worker is starting, "
                                          "retry shortly", retry=True)
            if self.state == "failed":
                return PrefillUnavailable(f"no prefill worker: {self.why}", retry=False)
            return None

    def _replace_locked(self, why: str) -> None:
        """(holding _state_lock) Stop the worker and start another on a thread of its own."""
        _stop(self.proc)
        self.state, self.why = "restarting", why
        self.restarts += 1

        def start() -> None:
            try:
                self._start()
            except QpcbuildError as exc:
                with self._state_lock:
                    self.state, self.why = "failed", str(exc)
                return
            with self._state_lock:
                self.state = "ready"
        threading.Thread(target=start, name="qpcbuild-prefill-restart", daemon=True).start()

    def prefill(self, heads: list[list[int]]) -> tuple[list[list[np.ndarray]], float]:
        """Each head's KV slices (per buffer [1, kv_heads, n, head_dim], copies out of the
        shared block) and the worker's prefill seconds."""
        if self.serving:
            refused = self.unavailable()
            if refused is not None:
                raise refused
        try:
            status, detail = self._ask(heads)
        except WorkerExited as exc:
            if self.serving:
                with self._state_lock:
                    self._replace_locked(str(exc))
                raise PrefillUnavailable(f"{exc}; a new prefill worker is starting, retry "
                                         "shortly", retry=True) from None
            _stop(self.proc)  # once: a new worker, the same request
            self.restarts += 1
            self._start()
            status, detail = self._ask(heads)
        if status != "done":
            raise QpcbuildError(f"the prefill worker failed: {detail}")
        sizes, seconds = detail
        out, offset = [], 0
        for n in sizes:
            shape = (1, self.kv_heads, n, self.head_dim)
            row = []
            for _ in range(self.buffers):
                view = np.ndarray(shape, np.float32, self.shm.buf, offset)
                row.append(view.copy())
                offset += view.nbytes
            out.append(row)
        return out, seconds

    def close(self) -> None:
        with self._state_lock:  # (not while a replacement is being decided)
            self._finalizer()


def _stop(proc: subprocess.Popen[str]) -> None:
    try:
        if proc.stdin:
            proc.stdin.close()  # the worker's loop ends
        proc.wait(5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    if proc.stdout:
        proc.stdout.close()


def _shutdown(live: dict[str, subprocess.Popen[str]], shm: shared_memory.SharedMemory) -> None:
    if "proc" in live:
        _stop(live["proc"])
    shm.close()
    shm.unlink()


class DisaggDecoder(SpecDecoder):
    """The decode node's loop: the target's prompt KV comes from the prefill worker; the rest
    (drafting, verifying, continuous batching) is SpecDecoder's."""

    def __init__(self, *args: Any, worker: PrefillWorker, log: HandoffLog, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.worker, self.log = worker, log
        # the last prompt token goes through the narrowest compiled decode window
        self.recompute_width = min(s.seq_len for s in self.target.specializations)

    def _admit(self, run: Any, batch: list[tuple[int, Row]]) -> None:
        """As SpecDecoder's, except that rows the prefill worker cannot take now end at once,
        unserved (Row.unavailable), and leave their slots free: the rows already decoding go
        on."""
        try:
            super()._admit(run, batch)
        except PrefillUnavailable as exc:
            for _, r in batch:
                if r.tokens:  # admitted before the worker failed
                    continue
                r.done, r.finish_reason, r.unavailable = True, "unavailable", str(exc)
                r.stats.e2e_s = self.clock() - r.arrival
                if run.on_token:
                    run.on_token(r.index, [])

    def _prefill(self, session: ModelSession, rows: list[Row], times: LoopTimes, kind: str,
                 slot: int | None = None) -> np.ndarray:
        if session is not self.target:
            return super()._prefill(session, rows, times, kind, slot)
        t0 = self.clock()
        heads = [r.prompt[:-1] for r in rows]
        todo = [h for h in heads if h]
        slices, prefill_s = self.worker.prefill(todo) if todo else ([], 0.0)
        assert isinstance(session, OrtSession)  # (the loader opens onnxruntime sessions only)
        side = _kv_side(session)
        got = iter(slices)
        per_row = []
        for i, head in enumerate(heads):
            kv_row = slot if slot is not None else i
            pieces = next(got) if head else []
            for buf, piece in zip(side, pieces):
                buf[kv_row:kv_row + 1, :, :piece.shape[2], :] = piece
            per_row.append(sum(p.nbytes for p in pieces))
        crossing = self.clock() - t0 - prefill_s
        for r, head, nbytes in zip(rows, heads, per_row):
            share = nbytes / max(1, sum(per_row))
            self.log.add(HandoffRecord(len(r.prompt), len(head), nbytes, prefill_s * share,
                                       crossing * share))
        # the last prompt token, recomputed here: its logits give the first output token
        b, w = session.batch_size, self.recompute_width
        ids = np.zeros((b, w), np.int64)
        pos = np.full((b, w), -1, np.int64)
        placed = []
        for i, r in enumerate(rows):
            kv_row = slot if slot is not None else i
            ids[kv_row, 0], pos[kv_row, 0] = r.prompt[-1], len(r.prompt) - 1
            placed.append(kv_row)
        logits = self._call(session, ids, pos, times, kind)
        return np.stack([logits[j, 0] for j in placed])


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])

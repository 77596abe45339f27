"""Progress of long steps (hashing, writing tensors, packing, prompts): rich bars on a terminal,
one plain line per finished step in a log, nothing for library callers.

Stages call `step(...)` wherever the work is; the command line chooses where it goes with
`report_to(console)`. One module-level reporter (not a context variable) so that steps run in
worker threads (target and draft export together) report too.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

Advance = Callable[[float], None]
_reporter: "_Bars | _Lines | None" = None


def amount(value: float, unit: str) -> str:
    """12.3 GB, 1,024 tensors: sizes in decimal units, counts as integers."""
    if unit != "bytes":
        return f"{int(value):,} {unit}"
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= scale:
            return f"{value / scale:.1f} {name}"
    return f"{int(value)} bytes"


def interval_s() -> float:
    """Seconds between progress lines in a log (QPCBUILD_PROGRESS_INTERVAL, default 10; 0 or
    less: only the line at the end)."""
    try:
        return float(os.environ.get("QPCBUILD_PROGRESS_INTERVAL", "10"))
    except ValueError:
        return 10.0


def progress_line(what: str, done: float, total: float | None, unit: str, seconds: float,
                  finished: bool) -> str:
    """`pulling x: 1.2 GB of 3.4 GB (35%), 110.3 MB/s, 11.0 s` while it runs; `... in 31.0 s`
    at the end. Rates per second, in the step's own unit."""
    rate = f"{amount(done / seconds, unit)}/s" if seconds > 0 and done else ""
    if unit == "bytes":
        rate = rate.replace(" bytes/s", " B/s")
    if finished:
        return f"{what}: {amount(done, unit)} in {seconds:.1f} s" + (f" ({rate})" if rate
                                                                      else "")
    share = f" of {amount(total, unit)} ({100 * done / total:.0f}%)" if total else ""
    return f"{what}: {amount(done, unit)}{share}" + (f", {rate}" if rate else "") + \
        f", {seconds:.1f} s so far"


class _Lines:
    """Outside a terminal (a log, a pipe, CI): a line every interval_s() while a step runs, as
    pip and docker print, and one when it ends; nothing that redraws."""

    def __init__(self, console):
        self.console = console

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    @contextmanager
    def step(self, what: str, total: float | None, unit: str) -> Iterator[Advance]:
        done = 0.0
        lock = threading.Lock()
        started = time.perf_counter()
        stop, every = threading.Event(), interval_s()

        def advance(n: float = 1) -> None:
            nonlocal done
            with lock:
                done += n

        def tick() -> None:
            while not stop.wait(every):
                self._print(progress_line(what, done, total, unit,
                                          time.perf_counter() - started, False))

        ticker = threading.Thread(target=tick, daemon=True, name="progress") if every > 0 \
            else None
        if ticker:
            ticker.start()
        try:
            yield advance
        finally:
            stop.set()
            if ticker:
                ticker.join()
        self._print(progress_line(what, done, total, unit, time.perf_counter() - started, True))


def fit(what: str, room: int) -> str:
    """`what` in at most `room` characters: its first word (the step's verb) and its end (the
    file's name), the middle left out."""
    if len(what) <= room:
        return what
    verb = what.split(" ", 1)[0]
    verb = verb if len(verb) + 8 <= room else ""
    head = f"{verb} …" if verb else "…"
    return head + what[len(what) - (room - len(head)):]


class _Bars:
    """On a terminal: one rich Progress shared by every step running at the time."""

    def __init__(self, console):
        self.console = console
        self.lock = threading.Lock()
        self.progress = None
        self.open = 0

    @contextmanager
    def step(self, what: str, total: float | None, unit: str,
             transient: bool = False) -> Iterator[Advance]:
        from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn,
                                   TimeElapsedColumn)

        width = self.console.width
        bar = 10 if width < 100 else 30
        with self.lock:
            if self.progress is None:
                self.progress = Progress(
                    TextColumn("{task.description}"), BarColumn(bar_width=bar),
                    TaskProgressColumn(), TextColumn("{task.fields[shown]}"),
                    TimeElapsedColumn(), console=self.console)
                self.progress.start()
            self.open += 1
            progress = self.progress
            # The counts stay whole and the description gives way in its middle: on an
            # 80-column terminal `hashing …/build/smollm2`, never `31.1 M…`.
            widest = len(amount(total, unit)) * 2 + 4 if total else 12
            room = max(16, width - bar - widest - 22)
            task = progress.add_task(fit(what, room), total=total, shown="")
        done = 0.0
        counting = threading.Lock()  # transfers advance from two threads

        def advance(n: float = 1) -> None:
            nonlocal done
            with counting:
                done += n
            progress.update(task, advance=n, shown=amount(done, unit) + (
                f" of {amount(total, unit)}" if total else ""))

        try:
            yield advance
        finally:
            with self.lock:
                if transient:
                    progress.remove_task(task)
                else:
                    progress.update(task, total=done or total, completed=done)
                self.open -= 1
                if not self.open:
                    progress.stop()
                    self.progress = None


@contextmanager
def running(what: str) -> Iterator[None]:
    """A step with nothing to count (an external compiler, a graph optimizer) whose end the
    caller reports itself: in a log, `what: running, 40 s so far` every interval_s(); on a
    terminal, a bar that pulses while it runs and goes when it ends."""
    if _reporter is None:
        yield
    elif isinstance(_reporter, _Lines):
        stop, every, started = threading.Event(), interval_s(), time.perf_counter()

        def tick() -> None:
            while not stop.wait(every):
                _reporter._print(f"{what}: running, {time.perf_counter() - started:.0f} s so far")

        ticker = threading.Thread(target=tick, daemon=True, name="progress")
        if every > 0:
            ticker.start()
        try:
            yield
        finally:
            stop.set()
            if every > 0:
                ticker.join()
    else:
        with _reporter.step(what, None, "s", transient=True):
            yield


@contextmanager
def step(what: str, total: float | None = None, unit: str = "files") -> Iterator[Advance]:
    """`with step("hashing bundle", total=n, unit="bytes") as advance: ... advance(k)`."""
    if _reporter is None:
        yield lambda n=1: None
        return
    with _reporter.step(what, total, unit) as advance:
        yield advance


def report_to(console) -> None:
    """Bars when `console` is a terminal, plain lines otherwise."""
    global _reporter
    _reporter = _Bars(console) if console.is_terminal else _Lines(console)

"""Progress of long steps (hashing, writing tensors, packing, prompts): rich bars on a terminal,
one plain line per finished step in a log, nothing for library callers.

Stages call `step(...)` wherever the work is; the command line chooses where it goes with
`report_to(console)`. One module-level reporter (not a context variable) so that steps run in
worker threads (target and draft export together) report too.
"""

from __future__ import annotations

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


class _Lines:
    """Outside a terminal: one full line per finished step, nothing that redraws."""

    def __init__(self, console):
        self.console = console

    @contextmanager
    def step(self, what: str, total: float | None, unit: str) -> Iterator[Advance]:
        done = 0.0
        lock = threading.Lock()
        started = time.perf_counter()

        def advance(n: float = 1) -> None:
            nonlocal done
            with lock:
                done += n

        yield advance
        self.console.print(f"{what}: {amount(done, unit)} in {time.perf_counter() - started:.1f} s",
                           markup=False, highlight=False, soft_wrap=True)


class _Bars:
    """On a terminal: one rich Progress shared by every step running at the time."""

    def __init__(self, console):
        self.console = console
        self.lock = threading.Lock()
        self.progress = None
        self.open = 0

    @contextmanager
    def step(self, what: str, total: float | None, unit: str) -> Iterator[Advance]:
        from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn,
                                   TimeElapsedColumn)

        with self.lock:
            if self.progress is None:
                self.progress = Progress(
                    TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                    TextColumn("{task.fields[shown]}"), TimeElapsedColumn(),
                    console=self.console)
                self.progress.start()
            self.open += 1
            progress = self.progress
            task = progress.add_task(what, total=total, shown="")
        done = 0.0

        def advance(n: float = 1) -> None:
            nonlocal done
            done += n
            progress.update(task, advance=n, shown=amount(done, unit) + (
                f" of {amount(total, unit)}" if total else ""))

        try:
            yield advance
        finally:
            with self.lock:
                progress.update(task, total=done or total, completed=done)
                self.open -= 1
                if not self.open:
                    progress.stop()
                    self.progress = None


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

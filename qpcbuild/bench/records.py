"""One measured configuration (ours or a peer's), as the measurement, the peers and the report
all keep it. Kept apart from measure.py so that the peers and the report, which measure.py
imports, do not import it back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..runtime.stats import SpecDecodingStats


@dataclass
class Measure:
    """One configuration: per-repeat wall time and tokens, plus summed statistics: our
    engine's record (`engine`, with the prefill calls it made) or a peer's own counters."""
    system: str
    method: str
    k: int | None
    label: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    outputs: list[list[list[int]]] = field(default_factory=list)  # per repeat, per prompt
    stats: dict[str, Any] = field(default_factory=dict)  # a peer's counters
    engine: SpecDecodingStats | None = None  # ours: the timed calls' records added up
    prefill_calls: int = 0  # ours: the target calls among engine.target_calls that prefilled
    error: str | None = None
    skipped: str | None = None

    def add_engine(self, record: SpecDecodingStats, prefill_calls: int) -> None:
        """One of our timed generate calls: its record, and how many target calls prefilled."""
        self.engine = record if self.engine is None else self.engine + record
        self.prefill_calls += prefill_calls

    def tps(self) -> list[float]:
        return [t / s if s > 0 else 0.0 for t, s in zip(self.tokens, self.seconds)]

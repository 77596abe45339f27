"""One measured configuration (ours or a peer's), as the measurement, the peers and the report
all keep it. Kept apart from measure.py so that the peers and the report, which measure.py
imports, do not import it back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Measure:
    """One configuration: per-repeat wall time and tokens, plus summed engine statistics."""
    system: str
    method: str
    k: int | None
    label: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    outputs: list[list[list[int]]] = field(default_factory=list)  # per repeat, per prompt
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    skipped: str | None = None

    def tps(self) -> list[float]:
        return [t / s if s > 0 else 0.0 for t, s in zip(self.tokens, self.seconds)]

"""Speculation policies: whether each verify step speculates, and with how many tokens.

The engine asks one policy object per step, whatever the bundle's `speculation.policy`:

    choose(rates)           the coming step's mode, "spec" or "plain", for the live rows
    start_step(mode, rows)  the step is about to run (counted on each row's statistics)
    finish_step(mode, s, row_tokens)  it ran: its seconds and each live row's new tokens
    shadow_due(rate)        whether a row proposes in the shadow before a plain step
    figures()               the steps and switches so far (None where nothing is reported)

`Fixed` speculates every step, `Off` never does, `gate.Goodput` (policy `auto`) speculates while
it makes more new tokens per second than plain steps; `TargetOnly` is what runs where nothing can
or should speculate (`--compare-baseline`, a bundle without a proposer): plain steps, nothing
counted. How many tokens a speculative step proposes is the K schedule's (`KSchedule`), and
where a draft model stops proposing early is the confidence stop's (`ConfidenceStop`). This is
the split vLLM makes between a draft-length policy and the proposer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from .rows import GateStats, Row, RowRate

Mode = Literal["spec", "plain"]
POLICIES = ("auto", "fixed", "off")  # the recipe's speculation.policy; auto: gate.Goodput


class SpeculationPolicy(Protocol):
    name: str
    shadowed: bool  # plain steps check shadow proposals (a model-free proposer under `auto`)
    switches: list[dict[str, Any]]

    def choose(self, rates: Sequence[RowRate]) -> Mode: ...

    def start_step(self, mode: Mode, rows: Sequence[Row]) -> None: ...

    def finish_step(self, mode: Mode, seconds: float,
                    row_tokens: Sequence[tuple[Row, int]]) -> None: ...

    def shadow_due(self, rate: RowRate) -> bool: ...

    def shadow_cost(self, seconds: float, proposals: int) -> None: ...

    def figures(self) -> GateStats | None: ...


@dataclass
class _Counted:
    """A policy whose every step takes one mode: it only counts the steps."""
    name: str
    mode: Mode
    shadowed: bool = False
    switches: list[dict[str, Any]] = field(default_factory=list)  # never switches
    steps_by_mode: dict[Mode, int] = field(default_factory=lambda: {"spec": 0, "plain": 0})

    def choose(self, rates: Sequence[RowRate]) -> Mode:
        return self.mode

    def start_step(self, mode: Mode, rows: Sequence[Row]) -> None:
        count_row_steps(mode, rows)

    def finish_step(self, mode: Mode, seconds: float,
                    row_tokens: Sequence[tuple[Row, int]]) -> None:
        self.steps_by_mode[mode] += 1

    def shadow_due(self, rate: RowRate) -> bool:
        return False

    def shadow_cost(self, seconds: float, proposals: int) -> None:
        pass

    def figures(self) -> GateStats | None:
        return GateStats(self.name, self.steps_by_mode["spec"], self.steps_by_mode["plain"])


class Fixed(_Counted):
    """Speculate every step (`speculation.policy: fixed`)."""

    def __init__(self) -> None:
        super().__init__("fixed", "spec")


class Off(_Counted):
    """Never speculate (`speculation.policy: off`); the steps are still counted and reported."""

    def __init__(self) -> None:
        super().__init__("off", "plain")


class TargetOnly(_Counted):
    """Plain steps where no speculation is possible or asked for (a target-only baseline, a
    bundle without a proposer): nothing is counted or reported."""

    def __init__(self) -> None:
        super().__init__("target_only", "plain")

    def start_step(self, mode: Mode, rows: Sequence[Row]) -> None:
        pass

    def finish_step(self, mode: Mode, seconds: float,
                    row_tokens: Sequence[tuple[Row, int]]) -> None:
        pass

    def figures(self) -> GateStats | None:
        return None


def count_row_steps(mode: Mode, rows: Sequence[Row]) -> None:
    """Each live row's steps with and without speculation, counted before the step runs (a
    caller that sees a row end sees its statistics complete)."""
    for r in rows:
        if mode == "spec":
            r.stats.spec_steps += 1
        else:
            r.stats.plain_steps += 1


@dataclass(frozen=True)
class KSchedule:
    """The K of a speculative step by the live batch size (`num_speculative_tokens_per_batch_size`,
    from `qpcbuild tune --per-batch`): the K of the largest scheduled batch size not above the
    live rows, capped at `k_max`; K = k_max where no batch size is scheduled."""
    ks: dict[int, int] = field(default_factory=dict)

    def k_for(self, live_rows: int, k_max: int) -> int:
        scheduled = [k for b, k in sorted(self.ks.items()) if b <= live_rows]
        return min(scheduled[-1], k_max) if scheduled else k_max


@dataclass(frozen=True)
class ConfidenceStop:
    """A draft model or an EAGLE-3 head stops proposing for a row once its most likely next
    token has less than `p_min` of its probability (`speculation.draft_p_min`; 0: never stops
    early)."""
    p_min: float = 0.0

    def stops(self, logits: np.ndarray, probs: np.ndarray | None) -> bool:
        """Whether the row stops at this draft position: `logits` the draft's, `probs` the
        distribution a sampled row draws from (None: a greedy row)."""
        return bool(self.p_min) and _top_probability(logits, probs) < self.p_min


def _top_probability(logits: np.ndarray, probs: np.ndarray | None) -> float:
    """The draft's confidence: the largest probability of the distribution it samples from
    (greedy rows: the plain softmax of its logits, 1 / sum(exp(x - max)))."""
    if probs is not None:
        return float(probs.max())
    # float32: numpy vectorizes its exp, float64's cost 7x as much here (12x over a vocabulary
    # subset's -inf rows: 0.44 ms a draft token at 49,152 entries, 3% of a SmolLM2 step). The
    # value is only compared with the threshold, where float32's rounding cannot matter.
    x = np.subtract(logits, logits.max(), dtype=np.float32)
    return float(1.0 / np.exp(x, out=x).sum())

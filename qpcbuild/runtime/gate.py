"""The goodput gate (`speculation.policy: auto`): speculate only while it yields more new tokens
per second than decoding without it (the compiled K=0 window, no draft calls, no proposals).

Each step it compares, for the live rows,

    speculate:  sum over rows of tokens_per_step(row) / seconds_per_step(spec)
    plain:      live rows / seconds_per_step(K=0)

and runs the faster; the mode not taken is re-measured now and then (a probe of a few steps,
the gap between probes doubling while they confirm the choice). Tokens per step are estimated per
row, seconds per step per mode for the whole batch. Switching asks for evidence (standard errors
from the step-to-step spread of tokens per step): speculation is turned off only when even its
estimate plus `evidence_z` errors loses, and on only when its estimate less `switch_on_z` errors
wins. With a model-free proposer, plain steps check shadow proposals (what the proposer would
have offered, matched against the tokens the plain steps produce), which measures acceptance at
no model call. Which tokens come out never depends on the choice: every step is verified by the
target, so output stays lossless.

The constants are GoodputConfig's; why each rule exists, and what it was measured to do, is in
docs/notes/gate-rules.md. benchmarks/gate_simulation.py is the gate's regression oracle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .policy import Fixed, Mode, Off, SpeculationPolicy, count_row_steps
from .rows import GateStats, Row, RowRate


@dataclass(frozen=True)
class GoodputConfig:
    """The gate's constants (docs/notes/gate-rules.md: each one's history and measurements)."""
    ema: float = 0.3  # weight of the newest step in the step-time estimates
    # weight of the newest speculative step in a row's tokens-per-step estimate (they vary far
    # more from step to step than a step's time)
    ema_tokens: float = 0.1
    warm_steps: int = 4  # speculative steps before the first plain probe
    probe_spec_steps: int = 4  # a speculative probe's length (acceptance needs a few)
    probe_plain_steps: int = 2
    first_backoff: int = 16  # steps between probes of the losing mode, doubling ...
    max_backoff: int = 512  # ... up to this
    margin: float = 0.05  # the other mode must be this much faster to switch
    spike: float = 2.0  # a step slower than this x the estimate counts as this x
    evidence_z: float = 0.75  # errors by which speculation must lose before it is turned off
    switch_on_z: float = 1.0  # errors by which it must win before it is turned on
    prior_steps: int = 4  # the pooled estimate counts as this many of a row's own steps
    shadow_budget: float = 0.02  # shadow proposals may cost this share of the plain steps' time


DEFAULT = GoodputConfig()


def ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class Goodput:
    """The goodput gate, one per decoder, policy and K (its estimates build up over a server's
    requests)."""
    shadowed: bool = False  # the proposer is model-free: plain steps check shadow proposals
    config: GoodputConfig = DEFAULT
    name: str = "auto"
    mode: Mode = "spec"
    step_s: dict[Mode, float | None] = field(default_factory=lambda: {"spec": None,
                                                                      "plain": None})
    pooled_tokens: float | None = None  # tokens per row-step while speculating, all rows
    pooled_samples: int = 0
    # mean squared deviation of a row-step's tokens from its row's estimate (ema_tokens)
    spread: float | None = None
    steps: int = 0
    steps_by_mode: dict[Mode, int] = field(default_factory=lambda: {"spec": 0, "plain": 0})
    switches: list[dict[str, Any]] = field(default_factory=list)
    shadow_checks: int = 0  # shadow proposals matched to the end
    shadow_s: float | None = None  # seconds per shadow proposal (EMA)
    _probe_left: int = 0
    _probe_mode: Mode = "plain"
    _next_probe: int = 0
    _backoff: int = 0

    def __post_init__(self) -> None:
        self._next_probe, self._backoff = self.config.warm_steps, self.config.first_backoff

    # ---------------------------------------------------------------- the policy's side
    def start_step(self, mode: Mode, rows: Sequence[Row]) -> None:
        count_row_steps(mode, rows)

    def finish_step(self, mode: Mode, seconds: float,
                    row_tokens: Sequence[tuple[Row, int]]) -> None:
        """The step's seconds and each live row's new tokens; with shadow proposals, a plain
        step's tokens are matched against them (one plain step after another only)."""
        self.record(mode, seconds, [(r.rate, n) for r, n in row_tokens])
        if not self.shadowed:
            return
        for r, _ in row_tokens:
            if mode == "plain" and not r.done:
                self.observe_plain(r.rate, r.tokens[-1], len(row_tokens))
            else:
                self.drop_shadow(r.rate)

    def figures(self) -> GateStats:
        return GateStats(self.name, self.steps_by_mode["spec"], self.steps_by_mode["plain"],
                         tuple(self.switches), self.shadow_checks)

    # ---------------------------------------------------------------- per step
    def choose(self, rates: Sequence[RowRate]) -> Mode:
        """The mode of the next step for these live rows."""
        if self._probe_left:
            return self._probe_mode
        best = self.compare(rates)
        if best != self.mode:  # the estimates moved (acceptance sank, or rose)
            self._switch(best, rates)
        if self.steps >= self._next_probe:
            other: Mode = "plain" if self.mode == "spec" else "spec"
            self._probe_mode = other
            self._probe_left = self.config.probe_spec_steps if other == "spec" else \
                self.config.probe_plain_steps
            return other
        return self.mode

    def record(self, mode: Mode, seconds: float,
               row_tokens: Sequence[tuple[RowRate, int]]) -> None:
        """A finished step: its mode, its seconds (model calls and the loop's own work) and
        each live row's new tokens."""
        self.steps += 1
        self.steps_by_mode[mode] += 1
        self.step_s[mode] = self._clipped(self.step_s[mode], seconds)
        probing = self._probe_left > 0
        if mode == "spec":
            for rate, n in row_tokens:
                if probing:
                    rate.probe_tokens.append(n)
                else:
                    self._learn(rate, n, self._row_weight)
        if not probing:
            return
        self._probe_left -= 1
        if self._probe_left:
            return
        if mode == "spec":
            self._take_probe([rate for rate, _ in row_tokens])
        rates = [rate for rate, _ in row_tokens]
        best = self.compare(rates)
        if best != self.mode:
            self._switch(best, rates)
            return
        # The probe confirmed the choice: look again later, and later still each time, unless
        # it was a speculative probe that lost by less than its error (inconclusive).
        if mode == "plain" or self._spec_loses(rates):
            self._backoff = min(2 * self._backoff, self.config.max_backoff)
        self._next_probe = self.steps + self._probe_gap()

    def _clipped(self, old: float | None, new: float) -> float:
        """A step time into its estimate, a stall (over `spike` x the estimate) clipped."""
        return ema(old, new if old is None else min(new, self.config.spike * old),
                   self.config.ema)

    def _learn(self, rate: RowRate, tokens: int, weight: float) -> None:
        # The plain mean of the steps so far until there are 1 / weight of them, then the
        # running average: an EMA seeded with the first step would let that one step (under
        # sampling, often a single token) weigh 0.9, 0.81, ... for the rest of a short request.
        if rate.tokens_per_step is not None:
            self.spread = ema(self.spread, (tokens - rate.tokens_per_step) ** 2,
                              self.config.ema_tokens)
        rate.samples += 1
        self.pooled_samples += 1
        rate.tokens_per_step = ema(rate.tokens_per_step, tokens, max(weight, 1 / rate.samples))
        # all rows: always the slow weight, whichever weight the row learns with
        self.pooled_tokens = ema(self.pooled_tokens, tokens,
                                 max(self.config.ema_tokens, 1 / self.pooled_samples))

    def _take_probe(self, rates: Sequence[RowRate]) -> None:
        """A speculative probe ended: each row's mean over its probe steps becomes its
        estimate (the pooled one: the mean over all of them)."""
        taken = [n for r in rates for n in r.probe_tokens]
        for r in rates:
            if r.probe_tokens:
                mean = sum(r.probe_tokens) / len(r.probe_tokens)
                for n in r.probe_tokens:
                    self.spread = ema(self.spread, (n - mean) ** 2, self.config.ema_tokens)
                r.tokens_per_step, r.samples = mean, len(r.probe_tokens)
                r.probe_tokens.clear()
        if taken:
            self.pooled_tokens, self.pooled_samples = sum(taken) / len(taken), len(taken)

    def _switch(self, mode: Mode, rates: Sequence[RowRate]) -> None:
        # The backoff starts over: the estimates that decided this may have moved by chance,
        # and a wrong choice kept for up to max_backoff steps costs far more (a draft model's
        # acceptance is not measured at all while speculation is off) than probing again soon.
        self.switches.append({"step": self.steps, "to": mode, "reason": self.why(rates)})
        self.mode = mode
        self._backoff = self.config.first_backoff
        self._next_probe = self.steps + self._probe_gap()

    @property
    def _row_weight(self) -> float:
        """The weight of a row's newest speculative step (shadowed rows: also of a shadow)."""
        # shadows bring a shadowed row back to speculating within a few steps, so it may
        # leave as quickly as it came (the slow weight kept a lucky shadow's speculation on
        # for 10-20 losing steps)
        return self.config.ema if self.shadowed else self.config.ema_tokens

    def _probe_gap(self) -> int:
        # With shadow proposals the acceptance is known without speculating; a speculative
        # probe would only re-time the step, which changes slowly.
        return self.config.max_backoff if self.shadowed and self.mode == "plain" \
            else self._backoff

    # ---------------------------------------------------------------- shadow proposals
    def shadow_due(self, rate: RowRate) -> bool:
        """Whether this row makes a shadow proposal before the coming plain step."""
        return self.shadowed and rate.shadow is None and rate.shadow_wait <= 0

    def shadow_cost(self, seconds: float, proposals: int) -> None:
        self.shadow_s = ema(self.shadow_s, seconds / proposals, self.config.ema)

    def observe_plain(self, rate: RowRate, token: int, live_rows: int) -> None:
        """A plain step gave this row `token`: match it against the row's shadow proposal. The
        proposal is settled at its first miss or its end, as verification would settle it:
        its matched prefix plus the target's own token."""
        if rate.shadow is None:
            rate.shadow_wait -= 1
            return
        if rate.shadow_hits < len(rate.shadow) and token == rate.shadow[rate.shadow_hits]:
            rate.shadow_hits += 1
            if rate.shadow_hits < len(rate.shadow):
                return
        # The faster weight: shadows are how a row gets back to speculating, and a return by
        # chance costs little (a plain probe re-checks it after first_backoff steps).
        self._learn(rate, rate.shadow_hits + 1, self.config.ema)
        self.shadow_checks += 1
        rate.shadow, rate.shadow_hits = None, 0
        rate.shadow_wait = self._shadow_gap(live_rows)

    def drop_shadow(self, rate: RowRate) -> None:
        """The row ended, or speculated, before its shadow proposal was settled."""
        rate.shadow, rate.shadow_hits = None, 0

    def _shadow_gap(self, live_rows: int) -> int:
        """Plain steps between a row's shadow proposals, so that `live_rows` rows' proposals
        cost at most `shadow_budget` of the plain steps' time."""
        plain_s = self.step_s["plain"]
        if self.shadow_s is None or not plain_s:
            return 0
        steps = math.ceil(live_rows * self.shadow_s / (self.config.shadow_budget * plain_s))
        return min(max(steps - 1, 0), self.config.max_backoff)

    def _spec_rates(self, rates: Sequence[RowRate], z: float) -> tuple[float, float]:
        """Speculation's new tokens per second for these rows: the estimate, and the estimate
        plus z standard errors. A row's estimate averages about (2 - w) / w steps (an EMA of
        weight w), or the steps it has had, whichever is fewer, and `prior_steps` of the
        pooled estimate. Only called once both modes have a step time."""
        horizon = (2 - self._row_weight) / self._row_weight
        pooled = self.pooled_tokens
        tokens = variance = 0.0
        for r in rates:
            if r.tokens_per_step is None:  # a new row: the pooled estimate, one step's error
                tokens += pooled or 1.0
                variance += self.spread or 0.0
                continue
            n = min(max(r.samples, 1), horizon)
            prior = self.config.prior_steps if pooled is not None else 0
            tokens += (n * r.tokens_per_step + prior * (pooled or 0.0)) / (n + prior)
            variance += (self.spread or 0.0) / (n + prior)
        # A verify window of K+1 tokens never costs less than the K=0 one: when the two
        # estimates say otherwise, that is a noisy step (they are measured at different times),
        # and it switched speculation on at one token per step.
        spec_s = max(self._measured("spec"), self._measured("plain"))
        return tokens / spec_s, (tokens + z * math.sqrt(variance)) / spec_s

    def _measured(self, mode: Mode) -> float:
        seconds = self.step_s[mode]
        assert seconds is not None, "compared before both modes were timed"
        return seconds

    def _spec_loses(self, rates: Sequence[RowRate]) -> bool:
        """Plain decoding is faster by `margin` even than speculation's estimate plus its
        error."""
        # Shadowed rows need no margin to leave: their shadows bring them back at no cost.
        margin = 0.0 if self.shadowed else self.config.margin
        return self._spec_rates(rates, self.config.evidence_z)[1] * (1 + margin) < \
            len(rates) / self._measured("plain")

    def compare(self, rates: Sequence[RowRate]) -> Mode:
        """The faster mode for these rows by the current estimates (every step: the reason
        is worded only for a switch, by `why`)."""
        spec_s, plain_s = self.step_s["spec"], self.step_s["plain"]
        if spec_s is None or plain_s is None or not rates:
            return self.mode
        # The current mode stays unless the other is faster by `margin`; speculation is turned
        # off only when it loses even by its estimate plus its error.
        if self.mode == "spec":
            return "plain" if self._spec_loses(rates) else "spec"
        # and turned on only when it wins even by its estimate less `switch_on_z` errors
        spec_low = self._spec_rates(rates, -self.config.switch_on_z)[1]
        return "plain" if len(rates) / plain_s * (1 + self.config.margin) >= spec_low else "spec"

    def why(self, rates: Sequence[RowRate]) -> str:
        """The estimates behind `compare`'s answer, in words."""
        spec_s, plain_s = self.step_s["spec"], self.step_s["plain"]
        if spec_s is None or plain_s is None or not rates:
            return "not measured yet"
        spec_rate, spec_high = self._spec_rates(rates, self.config.evidence_z)
        spec_low = self._spec_rates(rates, -self.config.switch_on_z)[1]
        spec_s = max(spec_s, plain_s)  # as _spec_rates counts it
        plain_rate = len(rates) / plain_s
        return (f"speculating {spec_rate:.1f} new tokens/s ({spec_low:.1f} to {spec_high:.1f}; "
                f"{spec_rate * spec_s / len(rates):.2f} per row-step, {spec_s * 1e3:.2f} ms/step) "
                f"vs plain {plain_rate:.1f} ({plain_s * 1e3:.2f} ms/step)")


def make_policy(name: str, shadowed: bool = False,
                config: GoodputConfig = DEFAULT) -> SpeculationPolicy:
    """The policy of a recipe's `speculation.policy` (POLICIES): `shadowed` where the proposer
    is model-free (only the goodput gate uses it)."""
    if name == "auto":
        return Goodput(shadowed, config)
    if name == "fixed":
        return Fixed()
    if name == "off":
        return Off()
    raise ValueError(f"unknown speculation policy '{name}' (auto | fixed | off)")

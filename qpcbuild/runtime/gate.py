"""Goodput-gated speculation: speculate only while it yields more new tokens per second than
decoding without it (the compiled K=0 window, no draft calls, no proposals).

The loop measures both sides as it runs. New tokens per step are estimated per row (each row's
own acceptance; a new row starts from the pooled estimate), seconds per step per mode for the
whole batch (rows share one window, so a step costs the same whichever rows propose). Each step
the gate compares

    speculate:  sum over live rows of tokens_per_step(row) / seconds_per_step(spec)
    plain:      live rows / seconds_per_step(K=0)

and runs the faster. The other mode is re-measured now and then (a probe of a few steps), with
the gap between probes doubling each time a probe confirms the choice (backoff) and starting
over after a switch. A speculative probe's own steps replace the acceptance estimate of its
rows (fresh evidence, where the running estimate had stopped moving while speculation was off);
between probes acceptance follows a slow running average, so that a few unlucky steps of
sampled decoding do not turn speculation off. A row's estimate is also averaged with the
pooled one (all rows) as if that were a few of the row's own steps, so that a new row's first
steps move it by their share of the evidence. Both switches ask for evidence (standard errors
from the step-to-step spread of tokens per step, which under sampling is as large as the
gain): speculation is turned off only when even its estimate plus 0.75 errors loses, and a
probe that finds speculation behind but within that error does not lengthen the gap to the
next one; it is turned on only when its estimate less one error wins. A gain that is real but
small next to the spread is then kept instead of being lost by chance, and one lucky probe or
shadow does not start a losing speculation. A speculative step is never counted cheaper than
a plain one (a K+1 window costs at least the K=0 window; estimates measured at different
times can say otherwise on a busy machine). A speculation spell that made its tokens slower
than plain steps would have delays the next one (16 steps, doubling with each losing spell in a
row): near break-even the estimates cross it by noise, and each crossing started a losing
spell. Which tokens come out never depends on the choice (every step is verified by the target
as always), so output stays lossless.

Shadow proposals (model-free proposers only): while speculation is off, a row now and then asks
its proposer what it would propose and matches that against the tokens the plain steps then
produce. For a proposal that costs no model call this measures the row's acceptance for free,
and it is the same measurement a speculative step makes: greedy verification accepts the
proposal's prefix that equals the target's own tokens, and speculative sampling accepts a
proposed token with the target's probability of it, which is the chance that the plain step
samples that very token. Speculation then resumes as soon as acceptance recovers, and the gate
no longer speculates to find out (its speculative probes only re-time a step, at the longest
gap). Shadows are spaced so that they cost at most SHADOW_BUDGET of the plain steps' time. As
shadows bring such a row back within a few steps, its speculative steps move its estimate with
the fast weight too, so that it leaves a speculation that stopped paying as fast as it came.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

POLICIES = ("auto", "fixed", "off")
EMA = 0.3  # weight of the newest step in the step-time estimates
# Weight of the newest speculative step in a row's tokens-per-step estimate: tokens per step
# vary far more from step to step than a step's time (1 to K+1 under sampling), and with 0.3
# a few short steps in a row turned speculation off on a pair where it paid 1.9x (Qwen2.5-Coder
# at temperature 1.0, docs/adaptive.md).
EMA_TOKENS = 0.1
WARM_STEPS = 4  # speculative steps before the first plain probe
PROBE_STEPS = {"spec": 4, "plain": 2}  # a probe's length per mode (acceptance needs a few)
FIRST_BACKOFF, MAX_BACKOFF = 16, 512  # steps between probes of the losing mode
MARGIN = 0.05  # the other mode must be this much faster to switch (noise is not a reason)
SPIKE = 2.0  # a step slower than this x the estimate counts as this x (a busy machine's stall)
# Standard errors by which speculation's estimate must lose before it is turned off. In
# benchmarks/gate_simulation.py (sampled steps, one gate across short requests) 0.75 kept
# 97-100% of fixed K's gain where speculation paid and stayed at or above 0.98x of plain
# decoding where it did not; 0 (a symmetric switch) kept 90-92% of the gain, 1.0 went down to
# 0.97x on the losing side (docs/adaptive.md).
EVIDENCE_Z = 0.75
SHADOW_BUDGET = 0.02  # shadow proposals may cost this share of the plain steps' time
# Standard errors by which speculation's estimate must win before it is turned on. Speculating
# on a row whose estimate rests on one lucky shadow or a short probe turned speculation on for
# 10-20 losing steps at a time; in benchmarks/gate_simulation.py 1.0 lifted the losing side
# from 0.96-0.97x to 0.98-0.99x of plain decoding and kept 99% of fixed K's gain where it pays.
SWITCH_ON_Z = 1.0
# A row's estimate is averaged with the pooled one (all rows, the slow weight) as if the pooled
# one were this many of the row's steps: a new row's first steps or shadows move its estimate
# by their share of the evidence, not all the way.
PRIOR_STEPS = 4


def ema(old: float | None, new: float, weight: float = EMA) -> float:
    return new if old is None else old + weight * (new - old)


def ema_clipped(old: float | None, new: float) -> float:
    return ema(old, new if old is None else min(new, SPIKE * old))


@dataclass
class RowRate:
    """A row's new tokens per speculative step (EMA); None until it has taken one or had a
    shadow proposal checked. `shadow`: a proposal made before a plain step and not verified,
    of which the plain steps' tokens have matched `shadow_hits` so far."""
    tokens_per_step: float | None = None
    samples: int = 0  # steps (or settled shadows) behind the estimate
    shadow: list[int] | None = None
    shadow_hits: int = 0
    shadow_wait: int = 0  # plain steps before the row's next shadow proposal
    probe_tokens: list[int] = field(default_factory=list)  # its steps in a speculative probe


@dataclass
class Spell:
    """The speculative steps since speculation was last turned on (probes not counted)."""
    seconds: float = 0.0
    tokens: int = 0
    row_steps: int = 0
    steps: int = 0

    def add(self, seconds: float, row_tokens: list[tuple[RowRate, int]]) -> None:
        self.seconds += seconds
        self.tokens += sum(n for _, n in row_tokens)
        self.row_steps += len(row_tokens)
        self.steps += 1

    def lost(self, plain_s: float | None) -> bool:
        """Plain steps (one token per live row) would have made its tokens in less time."""
        if not self.steps or not plain_s:
            return False
        rows_per_step = self.row_steps / self.steps
        return self.seconds > self.tokens / rows_per_step * plain_s


@dataclass
class SpecGate:
    policy: str = "fixed"
    shadowed: bool = False  # the proposer is model-free: plain steps check shadow proposals
    mode: str = "spec"  # "spec" | "plain"
    step_s: dict[str, float | None] = field(default_factory=lambda: {"spec": None,
                                                                     "plain": None})
    pooled_tokens: float | None = None  # tokens per row-step while speculating, all rows
    pooled_samples: int = 0
    # mean squared deviation of a row-step's tokens from its row's estimate (EMA_TOKENS)
    spread: float | None = None
    steps: int = 0
    steps_by_mode: dict[str, int] = field(default_factory=lambda: {"spec": 0, "plain": 0})
    switches: list[dict] = field(default_factory=list)
    shadow_checks: int = 0  # shadow proposals matched to the end
    shadow_s: float | None = None  # seconds per shadow proposal (EMA)
    _probe_left: int = 0
    _probe_mode: str | None = None
    _next_probe: int = WARM_STEPS
    _backoff: int = FIRST_BACKOFF
    _spell: Spell = field(default_factory=Spell)
    _cooldown: int = 0  # plain steps before speculation may be turned on again
    _next_entry: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown speculation policy '{self.policy}' "
                             f"({' | '.join(POLICIES)})")
        if self.policy == "off":
            self.mode = "plain"

    # ---------------------------------------------------------------- per step
    def choose(self, rates: list[RowRate]) -> str:
        """The mode of the next step for these live rows."""
        if self.policy != "auto":
            return self.mode
        if self._probe_left:
            return self._probe_mode
        best = self.compare(rates)
        if best != self.mode:  # the estimates moved (acceptance sank, or rose)
            self._switch(best, rates)
        if self.steps >= self._next_probe:
            other = "plain" if self.mode == "spec" else "spec"
            self._probe_mode, self._probe_left = other, PROBE_STEPS[other]
            return other
        return self.mode

    def record(self, mode: str, seconds: float, row_tokens: list[tuple[RowRate, int]]) -> None:
        """A finished step: its mode, its seconds (model calls and the loop's own work) and
        each live row's new tokens."""
        self.steps += 1
        self.steps_by_mode[mode] += 1
        self.step_s[mode] = ema_clipped(self.step_s[mode], seconds)
        probing = self.policy == "auto" and self._probe_left > 0
        if mode == "spec" and not probing and self.mode == "spec":
            self._spell.add(seconds, row_tokens)
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
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
        self._next_probe = self.steps + self._probe_gap()

    def _learn(self, rate: RowRate, tokens: int, weight: float = EMA_TOKENS) -> None:
        # The plain mean of the steps so far until there are 1 / weight of them, then the
        # running average: an EMA seeded with the first step would let that one step (under
        # sampling, often a single token) weigh 0.9, 0.81, ... for the rest of a short request.
        if rate.tokens_per_step is not None:
            self.spread = ema(self.spread, (tokens - rate.tokens_per_step) ** 2, EMA_TOKENS)
        rate.samples += 1
        self.pooled_samples += 1
        rate.tokens_per_step = ema(rate.tokens_per_step, tokens, max(weight, 1 / rate.samples))
        # all rows: always the slow weight, whichever weight the row learns with
        self.pooled_tokens = ema(self.pooled_tokens, tokens,
                                 max(EMA_TOKENS, 1 / self.pooled_samples))

    def _take_probe(self, rates: list[RowRate]) -> None:
        """A speculative probe ended: each row's mean over its probe steps becomes its
        estimate (the pooled one: the mean over all of them)."""
        taken = [n for r in rates for n in r.probe_tokens]
        for r in rates:
            if r.probe_tokens:
                mean = sum(r.probe_tokens) / len(r.probe_tokens)
                for n in r.probe_tokens:
                    self.spread = ema(self.spread, (n - mean) ** 2, EMA_TOKENS)
                r.tokens_per_step, r.samples = mean, len(r.probe_tokens)
                r.probe_tokens.clear()
        if taken:
            self.pooled_tokens, self.pooled_samples = sum(taken) / len(taken), len(taken)

    def _switch(self, mode: str, rates: list[RowRate]) -> None:
        # The backoff starts over: the estimates that decided this may have moved by chance,
        # and a wrong choice kept for up to MAX_BACKOFF steps costs far more (a draft model's
        # acceptance is not measured at all while speculation is off) than probing again soon.
        self.switches.append({"step": self.steps, "to": mode, "reason": self.why(rates)})
        if mode == "spec":
            self._spell = Spell()
        else:
            self._spell_ended()
        self.mode = mode
        self._backoff = FIRST_BACKOFF
        self._next_probe = self.steps + self._probe_gap()

    def _spell_ended(self) -> None:
        """Speculation is turned off: if its spell made tokens slower than plain steps would
        have, it is not turned on again for a while, for twice as long after each losing
        spell in a row (a shadow whose every token came true ends the wait: observe_plain).
        The estimates that turn it on are noisiest where speculation is close to break-even,
        and there each spell started by their noise lost (the demo pair's suffix at
        temperature 1.0 speculated in a third of its steps, at 0.92x)."""
        if self._spell.lost(self.step_s["plain"]):
            self._cooldown = min(2 * self._cooldown or FIRST_BACKOFF, MAX_BACKOFF)
        else:
            self._cooldown = 0
        self._next_entry = self.steps + self._cooldown

    @property
    def _row_weight(self) -> float:
        """The weight of a row's newest speculative step (shadowed rows: also of a shadow)."""
        # shadows bring a shadowed row back to speculating within a few steps, so it may
        # leave as quickly as it came (the slow weight kept a lucky shadow's speculation on
        # for 10-20 losing steps)
        return EMA if self.shadowed else EMA_TOKENS

    def _probe_gap(self) -> int:
        # With shadow proposals the acceptance is known without speculating; a speculative
        # probe would only re-time the step, which changes slowly.
        return MAX_BACKOFF if self.shadowed and self.mode == "plain" else self._backoff

    # ---------------------------------------------------------------- shadow proposals
    def shadow_due(self, rate: RowRate) -> bool:
        """Whether this row makes a shadow proposal before the coming plain step."""
        return self.policy == "auto" and self.shadowed and rate.shadow is None and \
            rate.shadow_wait <= 0

    def shadow_cost(self, seconds: float, proposals: int) -> None:
        self.shadow_s = ema(self.shadow_s, seconds / proposals)

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
        # chance costs little (a plain probe re-checks it after FIRST_BACKOFF steps).
        self._learn(rate, rate.shadow_hits + 1, EMA)
        if rate.shadow_hits == len(rate.shadow) >= 2:
            # Every proposed token came true: the text repeats itself, which near-break-even
            # noise does not do (sampled at a = 0.1, four in a row come one time in 10^4).
            self._next_entry = min(self._next_entry, self.steps)
        self.shadow_checks += 1
        rate.shadow, rate.shadow_hits = None, 0
        rate.shadow_wait = self._shadow_gap(live_rows)

    def drop_shadow(self, rate: RowRate) -> None:
        """The row ended, or speculated, before its shadow proposal was settled."""
        rate.shadow, rate.shadow_hits = None, 0

    def _shadow_gap(self, live_rows: int) -> int:
        """Plain steps between a row's shadow proposals, so that `live_rows` rows' proposals
        cost at most SHADOW_BUDGET of the plain steps' time."""
        plain_s = self.step_s["plain"]
        if self.shadow_s is None or not plain_s:
            return 0
        steps = math.ceil(live_rows * self.shadow_s / (SHADOW_BUDGET * plain_s))
        return min(max(steps - 1, 0), MAX_BACKOFF)

    def _spec_rates(self, rates: list[RowRate], z: float = EVIDENCE_Z) -> tuple[float, float]:
        """Speculation's new tokens per second for these rows: the estimate, and the estimate
        plus z standard errors. A row's estimate averages about (2 - w) / w steps (an EMA of
        weight w), or the steps it has had, whichever is fewer, and PRIOR_STEPS of the
        pooled estimate."""
        horizon = (2 - self._row_weight) / self._row_weight
        pooled = self.pooled_tokens
        tokens = variance = 0.0
        for r in rates:
            if r.tokens_per_step is None:  # a new row: the pooled estimate, one step's error
                tokens += pooled or 1.0
                variance += self.spread or 0.0
                continue
            n = min(max(r.samples, 1), horizon)
            prior = PRIOR_STEPS if pooled is not None else 0
            tokens += (n * r.tokens_per_step + prior * (pooled or 0.0)) / (n + prior)
            variance += (self.spread or 0.0) / (n + prior)
        # A verify window of K+1 tokens never costs less than the K=0 one: when the two
        # estimates say otherwise, that is a noisy step (they are measured at different times),
        # and it switched speculation on at one token per step.
        spec_s = max(self.step_s["spec"], self.step_s["plain"])
        return tokens / spec_s, (tokens + z * math.sqrt(variance)) / spec_s

    def _spec_loses(self, rates: list[RowRate]) -> bool:
        """Plain decoding is faster by MARGIN even than speculation's estimate plus its error."""
        # Shadowed rows need no margin to leave: their shadows bring them back at no cost.
        margin = 0.0 if self.shadowed else MARGIN
        return self._spec_rates(rates)[1] * (1 + margin) < len(rates) / self.step_s["plain"]

    def compare(self, rates: list[RowRate]) -> str:
        """The faster mode for these rows by the current estimates (every step: the reason
        is worded only for a switch, by `why`)."""
        spec_s, plain_s = self.step_s["spec"], self.step_s["plain"]
        if spec_s is None or plain_s is None or not rates:
            return self.mode
        # The current mode stays unless the other is faster by MARGIN; speculation is turned
        # off only when it loses even by its estimate plus its error.
        if self.mode == "spec":
            return "plain" if self._spec_loses(rates) else "spec"
        if self.steps < self._next_entry:  # waiting after a losing spell (_spell_ended)
            return "plain"
        # and turned on only when it wins even by its estimate less SWITCH_ON_Z errors
        spec_low = self._spec_rates(rates, -SWITCH_ON_Z)[1]
        return "plain" if len(rates) / plain_s * (1 + MARGIN) >= spec_low else "spec"

    def why(self, rates: list[RowRate]) -> str:
        """The estimates behind `compare`'s answer, in words."""
        spec_s, plain_s = self.step_s["spec"], self.step_s["plain"]
        if spec_s is None or plain_s is None or not rates:
            return "not measured yet"
        spec_rate, spec_high = self._spec_rates(rates)
        spec_low = self._spec_rates(rates, -SWITCH_ON_Z)[1]
        spec_s = max(spec_s, plain_s)  # as _spec_rates counts it
        plain_rate = len(rates) / plain_s
        return (f"speculating {spec_rate:.1f} new tokens/s ({spec_low:.1f} to {spec_high:.1f}; "
                f"{spec_rate * spec_s / len(rates):.2f} per row-step, {spec_s * 1e3:.2f} ms/step) "
                f"vs plain {plain_rate:.1f} ({plain_s * 1e3:.2f} ms/step)")

    def report(self) -> dict:
        return {"policy": self.policy, "steps_with_speculation": self.steps_by_mode["spec"],
                "steps_without_speculation": self.steps_by_mode["plain"],
                "shadow_checks": self.shadow_checks,
                "policy_switches": list(self.switches)}

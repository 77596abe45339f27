"""Acceptance and speed statistics, under vLLM's metric names where they exist.

One record, `SpecDecodingStats` (as vLLM's SpecDecodingStats): the engine fills it from a
generate call's rows and timings, records add up (`merged`), and every reader (run, bench,
tune, numerics) takes its counts and its derived figures from it. The figures are properties
computed here and nowhere else; the acceptance formulas themselves are in rates.py, which the
per-request record (rows.RequestStats) shares."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from .rates import acceptance_rate, mean_acceptance_length, per_position_acceptance
from .rows import GateStats, LoopTimes, RequestStats, Row

_TINY_S = 1e-9  # a divisor for a time that may be 0


def _sum_per_position(lists: Sequence[Sequence[int]]) -> tuple[int, ...]:
    width = max((len(x) for x in lists), default=0)
    return tuple(sum(x[j] for x in lists if j < len(x)) for j in range(width))


@dataclass(frozen=True)
class SpecDecodingStats:
    """The counts and times of one generate call, or of several added up (`merged`)."""
    method: str = ""
    generate_calls: int = 1  # generate calls added up in this record
    requests: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0  # new tokens after each request's first (the decode phase's)
    prefill_s: float = 0.0  # summed over the calls
    total_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    target_calls: int = 0  # prefill chunks included
    draft_calls: int = 0
    num_drafts: int = 0  # verify steps that carried at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    verify_windows: dict[int, int] = field(default_factory=dict)  # verify steps per window K
    catch_up_calls: int = 0  # draft prefill-window calls over tokens decoded without it
    speculation: GateStats | None = None  # the policy's figures (None: target only)
    per_request: tuple[RequestStats, ...] = ()

    @classmethod
    def from_rows(cls, rows: list[Row], times: LoopTimes, method: str) -> SpecDecodingStats:
        """The record of one generate call: its finished rows and the loop's timings."""
        new_tokens = sum(r.stats.new_tokens for r in rows)
        return cls(
            method=method, requests=len(rows), new_tokens=new_tokens,
            decode_tokens=max(new_tokens - len(rows), 0), prefill_s=times.prefill_s,
            total_s=times.total_s, draft_s=times.draft_s, target_s=times.target_s,
            target_calls=times.target_calls, draft_calls=times.draft_calls,
            num_drafts=sum(r.stats.num_drafts for r in rows),
            num_draft_tokens=sum(r.stats.num_draft_tokens for r in rows),
            num_accepted_tokens=sum(r.stats.num_accepted_tokens for r in rows),
            accepted_per_pos=_sum_per_position([r.stats.accepted_per_pos for r in rows]),
            verify_windows=dict(sorted(times.windows.items())),
            catch_up_calls=times.catch_up_calls, speculation=times.speculation,
            per_request=tuple(r.stats.snapshot() for r in rows))

    @classmethod
    def merged(cls, records: Sequence[SpecDecodingStats]) -> SpecDecodingStats:
        """Several records as one run's: counts and times add up, the figures follow from the
        sums (time to first token is the mean over the calls)."""
        if not records:
            raise ValueError("no records to merge")
        gates = [r.speculation for r in records if r.speculation is not None]
        windows: dict[int, int] = {}
        for r in records:
            for k, n in r.verify_windows.items():
                windows[k] = windows.get(k, 0) + n

        def total(name: str) -> Any:
            return sum(getattr(r, name) for r in records)

        return cls(
            method=records[0].method if all(r.method == records[0].method for r in records)
            else "", generate_calls=total("generate_calls"), requests=total("requests"),
            new_tokens=total("new_tokens"), decode_tokens=total("decode_tokens"),
            prefill_s=total("prefill_s"), total_s=total("total_s"), draft_s=total("draft_s"),
            target_s=total("target_s"), target_calls=total("target_calls"),
            draft_calls=total("draft_calls"), num_drafts=total("num_drafts"),
            num_draft_tokens=total("num_draft_tokens"),
            num_accepted_tokens=total("num_accepted_tokens"),
            accepted_per_pos=_sum_per_position([r.accepted_per_pos for r in records]),
            verify_windows=dict(sorted(windows.items())), catch_up_calls=total("catch_up_calls"),
            speculation=GateStats(gates[0].policy, sum(g.steps_with_speculation for g in gates),
                           sum(g.steps_without_speculation for g in gates),
                           tuple(s for g in gates for s in g.policy_switches),
                           sum(g.shadow_checks for g in gates)) if gates else None,
            per_request=tuple(q for r in records for q in r.per_request))

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        return SpecDecodingStats.merged([self, other])

    # ------------------------------------------------------------ derived figures
    @property
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float | None:
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)

    @property
    def acceptance_per_position(self) -> list[float]:
        return per_position_acceptance(self.accepted_per_pos, self.num_drafts)

    @property
    def ttft_s(self) -> float:
        """Time to first token as vLLM counts it, per request from its arrival to its first
        token, the mean over the requests (0 where there are none). Not the prefill's seconds:
        under continuous batching a request also waits for a free slot."""
        return statistics.fmean(r.ttft_s for r in self.per_request) if self.per_request else 0.0

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_s, _TINY_S)

    @property
    def e2e_tokens_per_s(self) -> float:
        return self.new_tokens / max(self.total_s, _TINY_S)

    @property
    def host_overhead_s(self) -> float:
        """Wall time outside the model calls: the loop's own work on the host."""
        return self.total_s - (self.draft_s + self.target_s)

    @property
    def host_overhead_fraction(self) -> float:
        return self.host_overhead_s / max(self.total_s, _TINY_S)

    # ------------------------------------------------------------ JSON
    def totals_json(self) -> dict[str, Any]:
        """The summed figures (`qpcbuild run --json`'s "total")."""
        return {
            "requests": self.requests, "new_tokens": self.new_tokens,
            "ttft_s": round(self.ttft_s, 4), "e2e_s": round(self.total_s, 4),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "e2e_tokens_per_s": round(self.e2e_tokens_per_s, 2),
            "draft_time_s": round(self.draft_s, 4), "target_time_s": round(self.target_s, 4),
            "host_overhead_s": round(self.host_overhead_s, 4),
            "host_overhead_fraction": round(self.host_overhead_fraction, 4),
            "target_calls": self.target_calls, "draft_calls": self.draft_calls,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": _round(self.acceptance_rate, 4),
            "mean_acceptance_length": _round(self.mean_acceptance_length, 4),
        }

    def to_json(self) -> dict[str, Any]:
        """A generate call's statistics (GenerationResult's JSON): the totals, the method,
        the gate's steps, the verify windows and each request's own."""
        return {
            "method": self.method, **self.totals_json(),
            **({"speculation": self.speculation.to_json()} if self.speculation else {}),
            "verify_windows": {str(k): n for k, n in sorted(self.verify_windows.items())},
            "draft_catch_up_calls": self.catch_up_calls,
            "per_request": [q.to_json() for q in self.per_request],
        }


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)

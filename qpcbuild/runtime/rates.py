"""The acceptance formulas, written once: a request's counters (rows.RowStats), a call's or a
run's record (stats.SpecDecodingStats) and the server's gauge all read them from here."""

from __future__ import annotations

from collections.abc import Sequence


def acceptance_rate(accepted: int, draft_tokens: int) -> float | None:
    """Accepted draft tokens over proposed ones (vLLM's draft acceptance rate); None when
    nothing was proposed."""
    return accepted / draft_tokens if draft_tokens else None


def mean_acceptance_length(accepted: int, drafts: int) -> float | None:
    """Tokens per drafted verify step: the target's own token plus the accepted ones (vLLM's
    mean acceptance length); None when no step carried a draft."""
    return 1 + accepted / drafts if drafts else None


def per_position_acceptance(accepted_per_pos: Sequence[int], drafts: int) -> list[float]:
    """Per draft position: how often it was accepted, over the drafted steps; empty when no
    step carried a draft."""
    return [a / drafts for a in accepted_per_pos] if drafts else []


class RequestFigures:
    """A request's own acceptance figures (the server's per-request response), for a class with
    the counters num_accepted_tokens, num_draft_tokens and num_drafts: 0 and 1 where nothing
    was drafted, not None, as vLLM's per-request metrics read."""

    num_accepted_tokens: int
    num_draft_tokens: int
    num_drafts: int

    @property
    def acceptance_rate(self) -> float:
        rate = acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)
        return 0.0 if rate is None else rate

    @property
    def mean_acceptance_length(self) -> float:
        length = mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)
        return 1.0 if length is None else length

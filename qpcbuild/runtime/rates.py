"""The acceptance formulas, written once: a request's record (rows.RequestStats), a call's or a
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


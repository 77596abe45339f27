"""The decoding loop's values: a request as the loop keeps it (Row, with its RequestStats), the
loop's timings (LoopTimes) and the prefill chunk layout. The engine (engine.py), the draft's
side of a step (drafting.py) and the replay (replay.py) all read these; none of them is
imported back from here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import UsageError
from .rates import acceptance_rate, mean_acceptance_length
from .sampling import SamplingParams

# (prompt index, new token ids); ids are empty when a cancelled row ends
TokenCallback = Callable[[int, list[int]], None]


@dataclass(frozen=True)
class GateStats:
    """A policy's figures over a call (or a run): verify steps with and without speculation,
    the switches between them, and the shadow proposals checked while it was off
    (docs/adaptive.md)."""
    policy: str
    steps_with_speculation: int
    steps_without_speculation: int
    policy_switches: tuple[dict[str, Any], ...] = ()
    shadow_checks: int = 0

    def since(self, earlier: GateStats) -> GateStats:
        """What happened after `earlier` was taken (a policy lives across calls)."""
        return GateStats(self.policy,
                         self.steps_with_speculation - earlier.steps_with_speculation,
                         self.steps_without_speculation - earlier.steps_without_speculation,
                         self.policy_switches[len(earlier.policy_switches):],
                         self.shadow_checks - earlier.shadow_checks)

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "steps_with_speculation": self.steps_with_speculation,
                "steps_without_speculation": self.steps_without_speculation,
                "shadow_checks": self.shadow_checks,
                "policy_switches": list(self.policy_switches)}


@dataclass
class RowRate:
    """A row's speculation state, kept by gate.Goodput: its new tokens per speculative step
    (EMA), None until it has taken one or had a shadow proposal checked. `shadow`: a proposal
    made before a plain step and not verified, of which the plain steps' tokens have matched
    `shadow_hits` so far."""
    tokens_per_step: float | None = None
    samples: int = 0  # steps (or settled shadows) behind the estimate
    shadow: list[int] | None = None
    shadow_hits: int = 0
    shadow_wait: int = 0  # plain steps before the row's next shadow proposal
    probe_tokens: list[int] = field(default_factory=list)  # its steps in a speculative probe


@dataclass
class RequestStats:
    """One request's statistics, the one record of them: the engine counts into it while the
    request runs, the server reads it live (per-request metrics), and a generate call's record
    (stats.SpecDecodingStats.per_request) keeps a `snapshot` of each as the call ended."""
    prompt_tokens: int = 0
    new_tokens: int = 0
    finish_reason: str = ""  # "" while the request runs (Row.finish_reason is this field)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_drafts: int = 0  # verify steps that carried at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    accepted_histogram: list[int] = field(default_factory=list)  # drafted steps by accepted
    target_calls: int = 0
    spec_steps: int = 0  # verify steps this row took with speculation on (goodput gate)
    plain_steps: int = 0  # ... and with it off

    # 0 and 1 where nothing was drafted, not None, as vLLM's per-request metrics read
    @property
    def acceptance_rate(self) -> float:
        rate = acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)
        return 0.0 if rate is None else rate

    @property
    def mean_acceptance_length(self) -> float:
        length = mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)
        return 1.0 if length is None else length

    def snapshot(self) -> RequestStats:
        """A copy that the row's further counting does not change."""
        return replace(self, accepted_per_pos=list(self.accepted_per_pos),
                       accepted_histogram=list(self.accepted_histogram))

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "finish_reason": self.finish_reason, "ttft_s": round(self.ttft_s, 4),
                "e2e_s": round(self.e2e_s, 4),
                "spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "steps_with_speculation": self.spec_steps,
                "steps_without_speculation": self.plain_steps}


@dataclass
class Eagle3RowState:
    """One row's EAGLE-3 head state (eagle3.py): the target's features by position, the head's
    cache, and how many positions of it the target has verified (0..verified-1)."""
    features: np.ndarray  # [ctx, H]
    keys: np.ndarray  # [1, nKV, ctx + K + 1, D]
    values: np.ndarray
    verified: int = 0
    binding: Any = None  # the fused head graph's I/O binding of this cache (eagle3.py)


@dataclass
class Row:
    prompt: list[int]
    limit: int  # total tokens (prompt + new) this row may reach
    tokens: list[int] = field(default_factory=list)
    target_len: int = 0  # tokens whose target KV is valid (positions 0..target_len-1)
    draft_len: int = 0
    done: bool = False
    index: int = -1  # position in the caller's prompt list (a request id when serving)
    stats: RequestStats = field(default_factory=RequestStats)
    sp: SamplingParams = field(default_factory=SamplingParams)
    # new_row seeds it; a row made otherwise (the loop's idle slots) never samples
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    arrival: float = field(default_factory=time.perf_counter)  # TTFT and e2e count from here
    cancelled: str = ""  # set from any thread to a finish reason: the row ends at the next step
    # Why the row ended unserved, for a part of the server that is being replaced (a
    # disaggregated bundle's prefill worker): the server answers 503
    unavailable: str = ""
    rate: RowRate = field(default_factory=RowRate)  # its new tokens per speculative step
    # turbo: the heads' logits [heads, V] at the row's last token (the target's last call)
    head_logits: np.ndarray | None = None
    # eagle3: the target's features by position and the head's cache (eagle3.py)
    eagle3: Eagle3RowState | None = None

    # The finish reason is the request's record's (one place); the loop sets it here.
    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason

    @finish_reason.setter
    def finish_reason(self, reason: str) -> None:
        self.stats.finish_reason = reason


def new_row(prompt: list[int], max_new_tokens: int, ctx_len: int, sp: SamplingParams,
            index: int) -> Row:
    """A request as the loop keeps it. Each row samples from its own generator, seeded from
    (seed, index) when a seed is given, so a row's output does not depend on its neighbours."""
    if not prompt:
        raise UsageError(f"prompt {index} is empty")
    if len(prompt) >= ctx_len:
        raise UsageError(f"prompt {index} has {len(prompt)} tokens; ctx_len is {ctx_len}, so a "
                         "prompt may have at most ctx_len - 1 tokens")
    if max_new_tokens <= 0:
        raise UsageError("max_new_tokens must be at least 1")
    rng = np.random.default_rng(None if sp.seed is None else [sp.seed, index])
    return Row(list(prompt), min(len(prompt) + max_new_tokens, ctx_len), index=index, sp=sp,
               rng=rng)


@dataclass
class LoopTimes:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0
    target_calls: int = 0
    draft_calls: int = 0
    catch_up_calls: int = 0  # draft prefill-window calls over tokens decoded without it
    catch_up_s: float = 0.0  # their seconds
    windows: dict[int, int] = field(default_factory=dict)  # verify steps per window K
    # verify steps per (live rows, the K the step allowed; 0 when the gate ran it plain):
    # shows the K schedule following the rows as they come and go
    step_ks: dict[tuple[int, int], int] = field(default_factory=dict)
    # the speculation policy's figures, under the stats JSON's name (None: target only)
    speculation: GateStats | None = None


def prefill_feeds(prompts: list[list[int]], p: int, ctx_len: int, batch: int,
                  tails: tuple[int, ...] = ()
                  ) -> Iterator[tuple[np.ndarray, np.ndarray, list[bool]]]:
    """The prefill calls for `prompts` (prompt i in batch row i): yields (ids, pos, ends) per
    call, [batch, w] each with -1 padding, and ends[i] True when prompt i's last token is in
    this call (its logits are row i's first). Every call but a prompt's last is w = p wide; the
    last goes through the narrowest compiled window that holds what is left (`tails`, the
    recipe's shapes.prefill_tail_seq_lens, else p), so a 70-token prompt is not computed as
    128. See `SpecDecoder._prefill` for the layout."""
    lengths = [len(x) for x in prompts]
    last = [(n - 1) // p for n in lengths]  # each prompt's last call
    for c in range(max(last) + 1):
        # A narrower window only while no row has ended: a row that ended in an earlier call
        # repeats its last chunk exactly as it was sent (width p), so its KV is rewritten
        # with bit-identical values.
        left = [n - c * p for n in lengths]
        w = prefill_window(max(left), p, tails) if min(left) > 0 else p
        ids = np.zeros((batch, w), np.int64)
        pos = np.full((batch, w), -1, np.int64)
        ends = []
        for i, prompt in enumerate(prompts):
            start = min(c, last[i]) * p  # a row that has ended repeats its last chunk
            if start + w > ctx_len and lengths[i] >= w:
                start = lengths[i] - w  # right-aligned over tokens already sent
            piece = prompt[start:start + w]
            ids[i, :len(piece)] = piece
            pos[i, :len(piece)] = np.arange(start, start + len(piece))
            ends.append(c == last[i])
        yield ids, pos, ends


def prefill_window(left: int, p: int, tails: tuple[int, ...]) -> int:
    """The window a prefill call of `left` remaining tokens goes through: the narrowest
    compiled one that holds them all, else the full prefill window p."""
    return min((w for w in tails if w >= left), default=p)


def prefill_calls(prompts: list[list[int]], p: int) -> int:
    """How many prefill calls `prefill_feeds` makes for these prompts (batched together)."""
    return max((len(x) - 1) // p for x in prompts) + 1

"""The speculative decoding loop, written against the compiled static shapes.

Per step: the proposer offers up to K tokens per row (draft model: K single-token draft calls;
n-gram / suffix: a lookup), the target verifies [last token, d1..dK] in one K+1 window at their
absolute positions, and each row keeps its accepted prefix plus the target's own next token.
Nothing is rolled back: rejected slots hold stale KV that the position-derived mask hides until
the next window overwrites it. This is the same control flow the card runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import UsageError
from . import drafting
from .gate import RowRate, SpecGate
from .proposers import Proposer
from .sampling import SamplingParams, accept_greedy, accept_sampling, probabilities, sample
from .session import ModelSession

# (prompt index, new token ids); ids are empty when a cancelled row ends
TokenCallback = Callable[[int, list[int]], None]


@dataclass
class RowStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
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

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class Row:
    prompt: list[int]
    limit: int  # total tokens (prompt + new) this row may reach
    tokens: list[int] = field(default_factory=list)
    target_len: int = 0  # tokens whose target KV is valid (positions 0..target_len-1)
    draft_len: int = 0
    done: bool = False
    finish_reason: str = ""
    index: int = -1  # position in the caller's prompt list (a request id when serving)
    stats: RowStats = field(default_factory=RowStats)
    sp: SamplingParams = field(default_factory=SamplingParams)
    rng: np.random.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)  # TTFT and e2e count from here
    cancelled: str = ""  # set from any thread to a finish reason: the row ends at the next step
    rate: RowRate = field(default_factory=RowRate)  # its new tokens per speculative step


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
    windows: dict[int, int] = field(default_factory=dict)  # verify steps per window K
    gate: dict = field(default_factory=dict)  # the goodput gate's steps and switches


class SpecDecoder:
    def __init__(self, target: ModelSession, draft: ModelSession | None,
                 proposer: Proposer | None, ks: tuple[int, ...], prefill_len: int,
                 eos_ids: set[int], method: str, continuous_batching: bool = False,
                 policy: str = "fixed", draft_p_min: float = 0.0,
                 k_schedule: dict[int, int] | None = None):
        self.target, self.draft, self.proposer = target, draft, proposer
        # speculation.policy (gate.py), draft_p_min (drafting.py) and the K per live batch
        # size (k_for): how each step speculates
        self.policy, self.draft_p_min = policy, draft_p_min
        self.k_schedule = dict(sorted((k_schedule or {}).items()))
        self._gates: dict[tuple, SpecGate] = {}
        self.ks, self.prefill_len, self.eos_ids, self.method = tuple(sorted(ks)), prefill_len, \
            eos_ids, method
        self.ctx_len, self.batch = target.ctx_len, target.batch_size
        # Continuous batching: `batch` KV slots; each request is prefilled alone into a free
        # slot (batch_index) and decode steps run over every slot.
        self.cb = continuous_batching
        self._slots = np.arange(self.batch, dtype=np.int64).reshape(-1, 1) if self.cb else None

    # ------------------------------------------------------------ model calls
    def _call(self, session: ModelSession, ids: np.ndarray, pos: np.ndarray, times: LoopTimes,
              kind: str, batch_index: np.ndarray | None = None) -> np.ndarray:
        if batch_index is None and self.cb:
            batch_index = self._slots
        t0 = time.perf_counter()
        logits = session.run(ids, pos, batch_index)
        dt = time.perf_counter() - t0
        if kind == "draft":
            times.draft_s += dt
            times.draft_calls += 1
        else:
            times.target_s += dt
            times.target_calls += 1
        return logits

    def _prefill(self, session: ModelSession, rows: list[Row], times: LoopTimes,
                 kind: str, slot: int | None = None) -> np.ndarray:
        """Chunks of prefill_len with -1 padding; returns each row's last-prompt-token logits.

        A row whose prompt ended in an earlier chunk repeats its last chunk (rewriting identical
        KV) rather than sending an all-padding row, and a final chunk that would run past the
        buffer is right-aligned over tokens already sent: no slot outside a row's own prefix is
        ever written, whichever graph lowering runs underneath."""
        b = 1 if slot is not None else session.batch_size
        index = None if slot is None else np.array([[slot]], np.int64)
        last = np.zeros((b, session.vocab_size), np.float32)
        for ids, pos, ends in prefill_feeds([r.prompt for r in rows], self.prefill_len,
                                            self.ctx_len, b):
            logits = self._call(session, ids, pos, times, kind, index)
            for i, end in enumerate(ends):
                if end:
                    last[i] = logits[i, 0]
        return last

    # ------------------------------------------------------------ proposals
    def _draft_proposals(self, rows: list[Row], want: list[int], times: LoopTimes):
        """Up to want[i] draft tokens per row, after bringing the draft up to date."""
        return drafting.propose(self, rows, want, times)

    def k_for(self, live_rows: int, k_max: int) -> int:
        """The K of a step: the schedule's K for the largest scheduled batch size not above
        the live rows (continuous batching: it follows the rows as they come and go)."""
        ks = [k for b, k in self.k_schedule.items() if b <= live_rows]
        return min(ks[-1], k_max) if ks else k_max

    def gate(self, policy: str | None = None, k: int | None = None) -> SpecGate:
        """The goodput gate of a policy and K (kept across calls: a server's estimates build
        up over its requests)."""
        key = (policy or self.policy, k)
        if key not in self._gates:
            self._gates[key] = SpecGate(key[0])
        return self._gates[key]

    # ------------------------------------------------------------ the loop
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sp: SamplingParams,
                 k: int | None = None, on_token: TokenCallback | None = None,
                 target_only: bool = False,
                 policy: str | None = None) -> tuple[list[Row], LoopTimes]:
        if not prompts:
            raise UsageError("no prompts given")
        if len(prompts) > self.batch and not self.cb:
            raise UsageError(f"{len(prompts)} prompts but the bundle was compiled for batch "
                             f"size {self.batch}; pass at most {self.batch} per batch")
        rows = [new_row(p, max_new_tokens, self.ctx_len, sp, n) for n, p in enumerate(prompts)]
        return rows, self.run_rows(rows, k, on_token, target_only, policy=policy)

    def replay(self, prompts: list[list[int]], outputs: list[list[int]], max_new_tokens: int,
               k: int | None = None) -> tuple[list[Row], LoopTimes]:
        """Greedy decoding of `prompts` at K with the target's greedy `outputs` already known:
        this decoder's own loop, the target answered from the outputs (see `replay.replay`)."""
        from .replay import replay
        return replay(self, prompts, outputs, max_new_tokens, k)

    def run_rows(self, rows: list[Row], k: int | None = None,
                 on_token: TokenCallback | None = None, target_only: bool = False,
                 incoming: Callable[[int], list[Row]] | None = None,
                 policy: str | None = None) -> LoopTimes:
        """Decode `rows` to the end. `incoming(n)`, when given, is asked for up to n more rows
        whenever KV slots are free (continuous batching: a server's queue). k: one K for
        every step (default: the K schedule, else the largest compiled K); policy: the
        speculation policy (default: the bundle's)."""
        k_max = max(self.ks) if k is None else k
        if k is not None and k not in self.ks:
            raise UsageError(f"K={k} is not compiled in this bundle (compiled: {list(self.ks)})")
        can_speculate = self.draft is not None or self.proposer is not None
        gate = self.gate(policy, k) if can_speculate and not target_only else None
        gate_mark = (dict(gate.steps_by_mode), len(gate.switches)) if gate else None
        times = LoopTimes()
        start = time.perf_counter()
        use_draft = self.draft is not None and not target_only
        # A gated run may never speculate on a request: its draft prefill waits until it does
        # (drafting.catch_up reads the prompt through the same prefill window then).
        lazy_draft = gate is not None and gate.policy != "fixed"
        self._proposing = self.proposer is not None and not target_only
        idle = Row([0], 1, tokens=[0], done=True)
        slots = [idle] * self.batch  # the row decoded in each batch position / KV slot
        waiting = list(reversed(rows))

        def admit(batch: list[tuple[int, Row]]) -> None:
            """Prefill requests into their slots (all at once, or one slot each with CB)."""
            t0 = time.perf_counter()
            groups = [[pair] for pair in batch] if self.cb else [batch]
            for group in groups:
                slot = group[0][0] if self.cb else None
                group_rows = [r for _, r in group]
                logits = self._prefill(self.target, group_rows, times, "target", slot)
                for j, (s, r) in enumerate(group):
                    first = int(logits[j].argmax()) if r.sp.greedy else \
                        sample(probabilities(logits[j], r.sp), r.rng)
                    r.tokens = r.prompt + [first]
                    r.target_len = r.stats.prompt_tokens = len(r.prompt)
                    r.stats.ttft_s = time.perf_counter() - r.arrival
                    slots[s] = r
                    self._commit(s, r, [first], on_token)
                if use_draft and lazy_draft:  # the draft reads the prompt when first needed
                    for r in group_rows:
                        r.draft_len = 0
                elif use_draft:
                    self._prefill(self.draft, group_rows, times, "draft", slot)
                    for r in group_rows:
                        r.draft_len = len(r.prompt)
                if self._proposing:  # as vLLM: the prompt, then the first sampled token
                    for s, r in group:
                        self.proposer.finish(s)
                        self.proposer.start(s, r.prompt)
                        self.proposer.extend(s, r.tokens[len(r.prompt):])
            times.prefill_s += time.perf_counter() - t0

        admit([(s, waiting.pop()) for s in range(min(self.batch, len(waiting)))])
        while True:
            for r in slots:
                if r.cancelled and not r.done:
                    r.done, r.finish_reason = True, r.cancelled
                    r.stats.e2e_s = time.perf_counter() - r.arrival
                    if on_token:
                        on_token(r.index, [])  # the row ended without a new token
            free = [s for s, r in enumerate(slots) if r.done]
            if self.cb and free and incoming is not None and len(waiting) < len(free):
                waiting[:0] = list(reversed(incoming(len(free) - len(waiting))))
            if self.cb and waiting and free:  # refill finished slots with waiting requests
                admit([(s, waiting.pop()) for s in free[:len(waiting)]])
            if all(r.done for r in slots):
                if waiting:  # every admitted request ended at its first token
                    continue
                break
            self._step(slots, k_max if k is not None else None, gate, use_draft, times,
                       on_token)
        times.total_s = time.perf_counter() - start
        if gate is not None:
            steps, switches = gate_mark
            times.gate = {"policy": gate.policy, "steps_with_speculation":
                          gate.steps_by_mode["spec"] - steps["spec"],
                          "steps_without_speculation":
                          gate.steps_by_mode["plain"] - steps["plain"],
                          "policy_switches": gate.switches[switches:]}
        if self._proposing:
            for i in range(self.batch):
                self.proposer.finish(i)
        return times

    def _step(self, slots: list[Row], k_fixed: int | None, gate: SpecGate | None,
              use_draft: bool, times: LoopTimes, on_token: TokenCallback | None) -> None:
        """One verify step over the slots: the gate's mode, the step's K, the proposals, the
        verification; then the step's seconds and each row's new tokens go to the gate."""
        t0 = time.perf_counter()
        live = [r for r in slots if not r.done]
        k_step = k_fixed if k_fixed is not None else self.k_for(len(live), max(self.ks))
        mode = "plain" if gate is None else gate.choose([r.rate for r in live])
        k_now = k_step if mode == "spec" else 0
        room = [0 if r.done else max(0, min(k_now, r.limit - len(r.tokens) - 1)) for r in slots]
        if not any(room):
            proposals, q = [[] for _ in slots], None
        elif use_draft:
            proposals, q = self._draft_proposals(slots, room, times)
        else:
            proposals = [self.proposer.propose(i, room[i]) if room[i] else []
                         for i in range(len(slots))]
            q = None
        before = [len(r.tokens) for r in live]
        for r in live if gate is not None else ():  # counted before a caller sees rows end
            if mode == "spec":
                r.stats.spec_steps += 1
            else:
                r.stats.plain_steps += 1
        self._verify(slots, proposals, q, times, on_token)
        if gate is None:
            return
        # the draft catching up after plain steps is part of what speculating costs (the
        # gate clips a step's time at twice its estimate, so it weighs in without swamping)
        seconds = time.perf_counter() - t0
        gate.record(mode, seconds, [(r.rate, len(r.tokens) - n) for r, n in zip(live, before)])

    def _verify(self, rows: list[Row], proposals: list[list[int]], q, times: LoopTimes,
                on_token: TokenCallback | None):
        need = max(len(p) for r, p in zip(rows, proposals) if not r.done)
        k_step = next((k for k in self.ks if k >= need), None)
        if k_step is None:
            raise UsageError(f"a proposal of {need} tokens exceeds the compiled Ks {list(self.ks)}")
        s = k_step + 1
        times.windows[k_step] = times.windows.get(k_step, 0) + 1
        ids = np.zeros((self.batch, s), np.int64)
        pos = np.full((self.batch, s), -1, np.int64)
        first_slot = [0] * len(rows)
        for i, r in enumerate(rows):
            if r.done:
                continue
            seq = [r.tokens[-1]] + proposals[i]
            start = len(r.tokens) - 1
            if start + s - 1 >= self.ctx_len - 1 and len(seq) < s:
                # Padding would reach the last slot (where the portable graph parks pads) or run
                # past the buffer (the fused graph writes pads after the real tokens): shift the
                # window left over already-verified tokens instead, recomputing identical KV.
                shift = min(s - len(seq), start)
                seq = r.tokens[start - shift:start] + seq
                start -= shift
                first_slot[i] = shift
            ids[i, :len(seq)] = seq
            pos[i, :len(seq)] = np.arange(start, start + len(seq))
        logits = self._call(self.target, ids, pos, times, "target")
        for i, r in enumerate(rows):
            if r.done:
                continue
            drafts = proposals[i]
            window = logits[i, first_slot[i]:first_slot[i] + len(drafts) + 1]
            if r.sp.greedy:
                n, nxt = accept_greedy(window, drafts)
            else:
                qi = np.stack(q[i]) if q and q[i] else None
                n, nxt = accept_sampling(probabilities(window, r.sp), qi, drafts, r.rng)
            old_len = len(r.tokens)
            new = drafts[:n] + [nxt]
            r.target_len = old_len + n
            if self.draft is not None and drafts:  # the draft's KV of rejected tokens is stale
                r.draft_len = min(r.draft_len, old_len + min(n, len(drafts)))
            r.tokens.extend(new)
            # Accepted drafts after an EOS are cut from the output, so they are not counted.
            self._commit(i, r, new, on_token, lambda: self._count(
                r.stats, len(drafts), min(n, len(r.tokens) - old_len)))
            if self._proposing:  # finished rows too: the suffix cache keeps whole requests
                self.proposer.extend(i, r.tokens[old_len:])

    @staticmethod
    def _count(st: RowStats, drafted: int, accepted: int) -> None:
        st.target_calls += 1
        if not drafted:
            return
        st.num_drafts += 1
        st.num_draft_tokens += drafted
        st.num_accepted_tokens += accepted
        if len(st.accepted_histogram) <= accepted:
            st.accepted_histogram += [0] * (accepted + 1 - len(st.accepted_histogram))
        st.accepted_histogram[accepted] += 1
        if len(st.accepted_per_pos) < drafted:
            st.accepted_per_pos += [0] * (drafted - len(st.accepted_per_pos))
        for j in range(accepted):
            st.accepted_per_pos[j] += 1

    def _commit(self, i: int, r: Row, new: list[int], on_token: TokenCallback | None,
                counted: Callable[[], None] | None = None) -> None:
        """Apply stop rules to freshly accepted tokens (EOS and the row's length budget), then
        `counted` (the step's statistics), then tell the caller: a caller that sees a row end
        sees its statistics complete."""
        start = len(r.tokens) - len(new)
        for j, t in enumerate(new):
            if t in self.eos_ids:
                del r.tokens[start + j + 1:]
                r.done, r.finish_reason = True, "eos"
                break
        if not r.done and len(r.tokens) >= r.limit:
            del r.tokens[r.limit:]
            r.done = True
            r.finish_reason = "length" if r.limit < self.ctx_len else "ctx_len"
        emitted = r.tokens[start:]
        r.stats.new_tokens = len(r.tokens) - len(r.prompt)
        if r.done:
            r.stats.e2e_s = time.perf_counter() - r.arrival
        if counted:
            counted()
        if on_token and emitted:
            on_token(r.index, emitted)


def prefill_feeds(prompts: list[list[int]], p: int, ctx_len: int, batch: int):
    """The prefill calls for `prompts` (prompt i in batch row i): yields (ids, pos, ends) per
    call, [batch, p] each with -1 padding, and ends[i] True when prompt i's last token is in
    this call (its logits are row i's first). See `SpecDecoder._prefill` for the layout."""
    chunks = [_chunk_starts(len(x), p, ctx_len) for x in prompts]
    for c in range(max(len(x) for x in chunks)):
        ids = np.zeros((batch, p), np.int64)
        pos = np.full((batch, p), -1, np.int64)
        for i, prompt in enumerate(prompts):
            start = chunks[i][min(c, len(chunks[i]) - 1)]
            piece = prompt[start:start + p]
            ids[i, :len(piece)] = piece
            pos[i, :len(piece)] = np.arange(start, start + len(piece))
        yield ids, pos, [c == len(x) - 1 for x in chunks]


def prefill_calls(prompts: list[list[int]], p: int, ctx_len: int) -> int:
    """How many prefill calls `prefill_feeds` makes for these prompts (batched together)."""
    return max(len(_chunk_starts(len(x), p, ctx_len)) for x in prompts)


def _chunk_starts(n: int, p: int, ctx_len: int) -> list[int]:
    """Start offsets of a prompt's prefill chunks; the last one is right-aligned when a padded
    chunk would run past the buffer."""
    starts = list(range(0, n, p))
    if starts[-1] + p > ctx_len and n >= p:
        starts[-1] = n - p
    return starts

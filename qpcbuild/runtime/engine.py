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
    target_calls: int = 0

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


class SpecDecoder:
    def __init__(self, target: ModelSession, draft: ModelSession | None,
                 proposer: Proposer | None, ks: tuple[int, ...], prefill_len: int,
                 eos_ids: set[int], method: str, continuous_batching: bool = False):
        self.target, self.draft, self.proposer = target, draft, proposer
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
        """K single-token draft calls (plus catch-up calls for rows that fully accepted)."""
        b = self.draft.batch_size
        while True:  # catch up: every active row must have exactly one unprocessed token
            behind = [i for i, r in enumerate(rows) if not r.done and want[i] > 0
                      and r.draft_len < len(r.tokens) - 1]
            if not behind:
                break
            ids, pos = np.zeros((b, 1), np.int64), np.full((b, 1), -1, np.int64)
            for i in behind:
                ids[i, 0], pos[i, 0] = rows[i].tokens[rows[i].draft_len], rows[i].draft_len
                rows[i].draft_len += 1
            self._call(self.draft, ids, pos, times, "draft")
        proposals: list[list[int]] = [[] for _ in rows]
        q: list[list[np.ndarray]] = [[] for _ in rows]
        for j in range(max(want, default=0)):
            ids, pos = np.zeros((b, 1), np.int64), np.full((b, 1), -1, np.int64)
            for i, r in enumerate(rows):
                if not r.done and j < want[i]:
                    ids[i, 0] = proposals[i][-1] if j else r.tokens[-1]
                    pos[i, 0] = len(r.tokens) - 1 + j
            logits = self._call(self.draft, ids, pos, times, "draft")
            for i, r in enumerate(rows):
                if r.done or j >= want[i]:
                    continue
                if r.sp.greedy:
                    proposals[i].append(int(logits[i, 0].argmax()))
                else:
                    probs = probabilities(logits[i, 0], r.sp)
                    q[i].append(probs)
                    proposals[i].append(sample(probs, r.rng))
        for i, r in enumerate(rows):
            if not r.done and want[i] > 0:
                r.draft_len = len(r.tokens) + want[i] - 1  # pending + all but the last draft
        return proposals, q

    # ------------------------------------------------------------ the loop
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sp: SamplingParams,
                 k: int | None = None, on_token: TokenCallback | None = None,
                 target_only: bool = False) -> tuple[list[Row], LoopTimes]:
        if not prompts:
            raise UsageError("no prompts given")
        if len(prompts) > self.batch and not self.cb:
            raise UsageError(f"{len(prompts)} prompts but the bundle was compiled for batch "
                             f"size {self.batch}; pass at most {self.batch} per batch")
        rows = [new_row(p, max_new_tokens, self.ctx_len, sp, n) for n, p in enumerate(prompts)]
        return rows, self.run_rows(rows, k, on_token, target_only)

    def replay(self, prompts: list[list[int]], outputs: list[list[int]], max_new_tokens: int,
               k: int | None = None) -> tuple[list[Row], LoopTimes]:
        """Greedy decoding of `prompts` at K with the target's greedy `outputs` already known:
        this decoder's own loop, the target answered from the outputs (see `replay.replay`)."""
        from .replay import replay
        return replay(self, prompts, outputs, max_new_tokens, k)

    def run_rows(self, rows: list[Row], k: int | None = None,
                 on_token: TokenCallback | None = None, target_only: bool = False,
                 incoming: Callable[[int], list[Row]] | None = None) -> LoopTimes:
        """Decode `rows` to the end. `incoming(n)`, when given, is asked for up to n more rows
        whenever KV slots are free (continuous batching: a server's queue)."""
        k_max = max(self.ks) if k is None else k
        if k is not None and k not in self.ks:
            raise UsageError(f"K={k} is not compiled in this bundle (compiled: {list(self.ks)})")
        times = LoopTimes()
        start = time.perf_counter()
        use_draft = self.draft is not None and not target_only
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
                if use_draft:
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
            room = [0 if r.done else max(0, min(k_max, r.limit - len(r.tokens) - 1))
                    for r in slots]
            if target_only:
                want, proposals, q = [0] * len(slots), [[] for _ in slots], None
            elif use_draft:
                want = room
                proposals, q = self._draft_proposals(slots, want, times)
            else:
                proposals = [self.proposer.propose(i, room[i]) if not r.done else []
                             for i, r in enumerate(slots)]
                want, q = [len(p) for p in proposals], None
            self._verify(slots, proposals, q, times, on_token)
        times.total_s = time.perf_counter() - start
        if self._proposing:
            for i in range(self.batch):
                self.proposer.finish(i)
        return times

    def _verify(self, rows: list[Row], proposals: list[list[int]], q, times: LoopTimes,
                on_token: TokenCallback | None):
        need = max(len(p) for r, p in zip(rows, proposals) if not r.done)
        k_step = next((k for k in self.ks if k >= need), None)
        if k_step is None:
            raise UsageError(f"a proposal of {need} tokens exceeds the compiled Ks {list(self.ks)}")
        s = k_step + 1
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
            if self.draft is not None and drafts:
                r.draft_len = min(r.draft_len, old_len + min(n, len(drafts) - 1))
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

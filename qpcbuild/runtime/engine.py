"""The speculative decoding loop, written against the compiled static shapes.

Per step: the proposer offers up to K tokens per row (draft model: K single-token draft calls;
n-gram / suffix: a lookup), the target verifies [last token, d1..dK] in one K+1 window at their
absolute positions, and each row keeps its accepted prefix plus the target's own next token.
Nothing is rolled back: rejected slots hold stale KV that the position-derived mask hides until
the next window overwrites it. This is the same control flow the card runs.
"""
# Over 400 lines: one loop for every proposer (draft model, lookups, turbo and EAGLE-3 heads)
# and every batching mode, whose steps share the rows' state.

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import UsageError
from . import drafting
from .gate import make_policy
from .policy import ConfidenceStop, KSchedule, SpeculationPolicy, TargetOnly
from .proposers import Proposer
# The loop's values live in rows.py (drafting and replay read them without importing the
# engine); they are named here too, where the loader and the server have always found them.
from .rows import (LoopTimes, RequestStats, Row, TokenCallback, new_row, prefill_calls,  # noqa: F401
                   prefill_feeds)
from .sampling import (SamplingParams, WindowProbabilities, accept_greedy, accept_sampling,
                       probabilities, sample)
from .heads import keep_head_logits, propose_from_heads
from .eagle3 import Eagle3Drafter
from .model_session import FeatureSession, HeadsSession, ModelSession, padded_window


@dataclass
class _Run:
    """What the steps of one `run_rows` call share."""
    times: LoopTimes
    slots: list[Row]  # the row decoded in each batch position / KV slot
    waiting: list[Row]  # requests not yet admitted, the next one last
    k_fixed: int | None  # one K for every step, or None: the K schedule decides per step
    policy: SpeculationPolicy
    draft: ModelSession | None  # the draft model when it proposes in this run
    heads: HeadsSession | None  # the target's turbo heads when they propose in this run
    eagle3: Eagle3Drafter | None  # the EAGLE-3 head when it proposes in this run
    proposer: Proposer | None  # the model-free proposer when it proposes in this run
    lazy_draft: bool  # the draft reads a prompt only once the row first speculates
    on_token: TokenCallback | None
    incoming: Callable[[int], list[Row]] | None


class SpecDecoder:
    def __init__(self, target: ModelSession, draft: ModelSession | None,
                 proposer: Proposer | None, ks: tuple[int, ...], prefill_len: int,
                 eos_ids: set[int], method: str, continuous_batching: bool = False,
                 policy: str = "fixed", draft_p_min: float = 0.0,
                 num_speculative_tokens_per_batch_size: dict[int, int] | None = None,
                 prefill_tails: tuple[int, ...] = (),
                 clock: Callable[[], float] = time.perf_counter,
                 heads: HeadsSession | None = None, eagle3: Eagle3Drafter | None = None):
        """heads: the target itself when turbo heads are compiled into it (heads.py).
        eagle3: an EAGLE-3 head reading the target's features (eagle3.py)."""
        self.target, self.draft, self.proposer = target, draft, proposer
        self.heads, self.eagle3 = heads, eagle3
        self.prefill_tails = tuple(sorted(prefill_tails))  # narrower last-chunk windows
        # How each step speculates (policy.py): speculation.policy's object per policy and K,
        # the draft's confidence stop and the K per live batch size
        self.policy = policy
        self.confidence_stop = ConfidenceStop(draft_p_min)
        self.k_schedule = KSchedule(dict(num_speculative_tokens_per_batch_size or {}))
        self._gates: dict[tuple[str, int | None], SpeculationPolicy] = {}
        # every time the loop measures (its timings, the gate's step seconds) is read from here
        self.clock = clock
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
        t0 = self.clock()
        logits = session.run(ids, pos, batch_index)
        dt = self.clock() - t0
        if kind == "draft":
            times.draft_s += dt
            times.draft_calls += 1
        else:
            times.target_s += dt
            times.target_calls += 1
        return logits

    def _prefill(self, session: ModelSession, rows: list[Row], times: LoopTimes,
                 kind: str, slot: int | None = None) -> np.ndarray:
        """Chunks of prefill_len with -1 padding, the last through the narrowest compiled
        window that holds it (rows.prefill_feeds); returns each row's last-prompt-token logits.

        A row whose prompt ended in an earlier chunk repeats its last chunk (rewriting identical
        KV) rather than sending an all-padding row, and a final chunk that would run past the
        buffer is right-aligned over tokens already sent: no slot outside a row's own prefix is
        ever written, whichever graph lowering runs underneath."""
        b = 1 if slot is not None else session.batch_size
        index = None if slot is None else np.array([[slot]], np.int64)
        last = np.zeros((b, session.vocab_size), np.float32)
        for ids, pos, ends in prefill_feeds([r.prompt for r in rows], self.prefill_len,
                                            self.ctx_len, b, self.prefill_tails):
            logits = self._call(session, ids, pos, times, kind, index)
            self._keep_features(session, rows, pos)
            for i, end in enumerate(ends):
                if end:
                    last[i] = logits[i, 0]
                    if self.heads is not None and session is self.target:
                        keep_head_logits(rows[i], self.heads.head_logits()[i, 0])
        return last

    def _keep_features(self, session: ModelSession, rows: list[Row], pos: np.ndarray) -> None:
        """An EAGLE-3 head's features of the target's last call, kept by the rows' positions."""
        if self.eagle3 is not None and session is self.target:
            assert isinstance(session, FeatureSession)
            self.eagle3.keep(rows, pos, session.features())

    # ------------------------------------------------------------ policy
    def gate(self, policy: str | None = None, k: int | None = None) -> SpeculationPolicy:
        """The speculation policy's object for a policy name and K (kept across calls: the
        goodput gate's estimates build up over a server's requests)."""
        key = (policy or self.policy, k)
        if key not in self._gates:
            # a model-free proposer's acceptance is checked for free while speculation is off
            self._gates[key] = make_policy(key[0], shadowed=self.proposer is not None and
                                           self.draft is None)
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

    def run_rows(self, rows: list[Row], k: int | None = None,
                 on_token: TokenCallback | None = None, target_only: bool = False,
                 incoming: Callable[[int], list[Row]] | None = None,
                 policy: str | None = None) -> LoopTimes:
        """Decode `rows` to the end. `incoming(n)`, when given, is asked for up to n more rows
        whenever KV slots are free (continuous batching: a server's queue). k: one K for
        every step (default: the K schedule, else the largest compiled K); policy: the
        speculation policy (default: the bundle's).

        The loop: admit requests into free slots, then steps of propose -> verify -> commit
        until every row is done and none waits."""
        if k is not None and k not in self.ks:
            raise UsageError(f"K={k} is not compiled in this bundle (compiled: {list(self.ks)})")
        can_speculate = self.draft is not None or self.proposer is not None or \
            self.heads is not None or self.eagle3 is not None
        gate = self.gate(policy, k) if can_speculate and not target_only else TargetOnly()
        mark = gate.figures()
        times = LoopTimes()
        start = self.clock()
        # A run that may not speculate on a request reads its prompt into the draft only once
        # it does (drafting.catch_up reads it through the same prefill window then).
        lazy_draft = gate.name != "fixed"
        idle = Row([0], 1, tokens=[0], done=True)
        run = _Run(times, [idle] * self.batch, list(reversed(rows)), k, gate,
                   None if target_only else self.draft, None if target_only else self.heads,
                   None if target_only else self.eagle3,
                   None if target_only else self.proposer,
                   lazy_draft, on_token, incoming)
        self._admit(run, [(s, run.waiting.pop()) for s in range(min(self.batch, len(rows)))])
        while self._schedule(run):
            self._step(run)
        times.total_s = self.clock() - start
        now = gate.figures()
        times.speculation = now.since(mark) if now is not None and mark is not None else None
        if run.proposer is not None:
            for i in range(self.batch):
                run.proposer.finish(i)
        return times

    # ------------------------------------------------------------ admit
    def _admit(self, run: _Run, batch: list[tuple[int, Row]]) -> None:
        """Prefill requests into their slots (all at once, or one slot each with CB): each row's
        first token comes from the target's prefill; the draft and the proposer read the
        prompt too."""
        t0 = self.clock()
        groups = [[pair] for pair in batch] if self.cb else [batch]
        for group in groups:
            slot = group[0][0] if self.cb else None
            group_rows = [r for _, r in group]
            logits = self._prefill(self.target, group_rows, run.times, "target", slot)
            for j, (s, r) in enumerate(group):
                first = int(logits[j].argmax()) if r.sp.greedy else \
                    sample(probabilities(logits[j], r.sp), r.rng)
                r.tokens = r.prompt + [first]
                r.target_len = r.stats.prompt_tokens = len(r.prompt)
                r.stats.ttft_s = self.clock() - r.arrival
                run.slots[s] = r
                self._commit(s, r, [first], run.on_token)
            if run.draft is not None and run.lazy_draft:  # read when first needed
                for r in group_rows:
                    r.draft_len = 0
            elif run.draft is not None:
                self._prefill(run.draft, group_rows, run.times, "draft", slot)
                for r in group_rows:
                    r.draft_len = len(r.prompt)
            if run.proposer is not None:  # as vLLM: the prompt, then the first sampled token
                for s, r in group:
                    run.proposer.finish(s)
                    run.proposer.start(s, r.prompt)
                    run.proposer.extend(s, r.tokens[len(r.prompt):])
        run.times.prefill_s += self.clock() - t0

    def _schedule(self, run: _Run) -> bool:
        """Between steps: end cancelled rows and admit waiting requests into free slots (with
        continuous batching, asking `incoming` for more). False when every row is done and
        none waits."""
        slots, waiting = run.slots, run.waiting
        while True:
            for r in slots:
                if r.cancelled and not r.done:
                    r.done, r.finish_reason = True, r.cancelled
                    r.stats.e2e_s = self.clock() - r.arrival
                    if run.on_token:
                        run.on_token(r.index, [])  # the row ended without a new token
            free = [s for s, r in enumerate(slots) if r.done]
            if self.cb and free and run.incoming is not None and len(waiting) < len(free):
                waiting[:0] = list(reversed(run.incoming(len(free) - len(waiting))))
            if self.cb and waiting and free:  # refill finished slots with waiting requests
                self._admit(run, [(s, waiting.pop()) for s in free[:len(waiting)]])
            if not all(r.done for r in slots):
                return True
            if not waiting:
                return False
            # else every admitted request ended at its first token: admit again

    # ------------------------------------------------------------ one step
    def _step(self, run: _Run) -> None:
        """One verify step over the slots: the policy's mode and the step's K, then propose ->
        verify -> commit; then the step's seconds and each row's new tokens go to the policy."""
        t0, caught_up = self.clock(), run.times.catch_up_s
        slots, gate = run.slots, run.policy
        live = [r for r in slots if not r.done]
        k_step = run.k_fixed if run.k_fixed is not None else \
            self.k_schedule.k_for(len(live), max(self.ks))
        mode = gate.choose([r.rate for r in live])
        k_now = k_step if mode == "spec" else 0
        run.times.step_ks[len(live), k_now] = run.times.step_ks.get((len(live), k_now), 0) + 1
        room = [0 if r.done else max(0, min(k_now, r.limit - len(r.tokens) - 1)) for r in slots]
        proposals, q = self._propose(run, room)
        if mode == "plain" and run.proposer is not None:
            self._shadow_propose(slots, gate, run.proposer, k_step)
        before = [len(r.tokens) for r in live]
        gate.start_step(mode, live)  # counted before a caller sees rows end
        logits, first_slot = self._verify(slots, proposals, run.times)
        self._commit_step(run, proposals, q, logits, first_slot)
        # The draft catching up on tokens decoded without it (after plain steps, or a prompt
        # whose draft prefill waited for the first speculative step) is a cost of switching,
        # paid once: it stays out of the seconds per speculative step, which decide whether
        # to keep speculating (counted in, it made a good draft look twice as dear after each
        # probe).
        seconds = self.clock() - t0 - (run.times.catch_up_s - caught_up)
        gate.finish_step(mode, seconds, [(r, len(r.tokens) - n) for r, n in zip(live, before)])

    def _shadow_propose(self, slots: list[Row], gate: SpeculationPolicy, proposer: Proposer,
                        k: int) -> None:
        """Before a plain step: the proposals that rows due for a shadow check would make now
        (gate.py: matched against the plain steps' tokens, never verified). The proposer's
        `propose` reads its state without changing it, so the output is untouched."""
        due = [i for i, r in enumerate(slots) if not r.done and gate.shadow_due(r.rate)]
        if not due:
            return
        t0 = self.clock()
        for i in due:
            r = slots[i]
            r.rate.shadow = proposer.propose(i, max(0, min(k, r.limit - len(r.tokens) - 1)))
        gate.shadow_cost(self.clock() - t0, len(due))

    def _propose(self, run: _Run, room: list[int]
                 ) -> tuple[list[list[int]], list[list[np.ndarray]] | None]:
        """Up to room[i] proposed tokens per row (the draft after bringing it up to date, or the
        proposer's lookup), and the draft's distributions q of sampled rows (else None)."""
        if not any(room):
            return [[] for _ in run.slots], None
        if run.draft is not None:
            return drafting.propose(self, run.draft, run.slots, room, run.times)
        if run.heads is not None:
            return propose_from_heads(run.slots, room)
        if run.eagle3 is not None:  # the head's calls are the draft's time and calls
            t0, calls = self.clock(), run.eagle3.calls
            out = run.eagle3.propose(run.slots, room, self.confidence_stop)
            run.times.draft_s += self.clock() - t0
            run.times.draft_calls += run.eagle3.calls - calls
            return out
        proposer = run.proposer
        assert proposer is not None, "a speculative step without a draft or a proposer"
        return [proposer.propose(i, room[i]) if room[i] else []
                for i in range(len(run.slots))], None

    def _verify(self, rows: list[Row], proposals: list[list[int]], times: LoopTimes
                ) -> tuple[np.ndarray, list[int]]:
        """The target scores [last token, proposals] of every live row in one window of the
        smallest compiled K that holds them; returns its logits and where each row's window
        starts in them."""
        need = max(len(p) for r, p in zip(rows, proposals) if not r.done)
        k_step = next((k for k in self.ks if k >= need), None)
        if k_step is None:
            raise UsageError(f"a proposal of {need} tokens exceeds the compiled Ks {list(self.ks)}")
        # A target whose logits depend on a call's width (an int8/int4 one on ONNX Runtime) gets
        # every window padded as its session says, target-only decode included, so that
        # speculation and target-only compute each token alike (model_session.padded_window).
        s = padded_window(self.target, k_step + 1)
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
        self._keep_features(self.target, rows, pos)
        # The graph keeps the N logits rows that end at each row's last real token. A compiled
        # window keeps one per token (N = s); a lone token padded to the target's floor keeps
        # fewer (N = 1: the LM head skips the padding), so a shifted row's own rows start
        # earlier among them.
        kept = logits.shape[1]
        return logits, [f - max(f + len(p) + 1 - kept, 0) for f, p in zip(first_slot, proposals)]

    def _commit_step(self, run: _Run, proposals: list[list[int]],
                     q: list[list[np.ndarray]] | None, logits: np.ndarray,
                     first_slot: list[int]) -> None:
        """Each live row keeps its accepted prefix plus the target's own next token (greedy
        or speculative sampling), then the stop rules, statistics and the caller's callback."""
        head_logits = self.heads.head_logits() if self.heads is not None else None
        for i, r in enumerate(run.slots):
            if r.done:
                continue
            drafts = proposals[i]
            window = logits[i, first_slot[i]:first_slot[i] + len(drafts) + 1]
            if r.sp.greedy:
                n, nxt = accept_greedy(window, drafts)
            else:
                qi = np.stack(q[i]) if q and q[i] else None
                n, nxt = accept_sampling(WindowProbabilities(window, r.sp), qi, drafts, r.rng)
            if head_logits is not None:  # at the last accepted token
                keep_head_logits(r, head_logits[i, first_slot[i] + n])
            old_len = len(r.tokens)
            new = drafts[:n] + [nxt]
            r.target_len = old_len + n
            if self.draft is not None and drafts:  # the draft's KV of rejected tokens is stale
                r.draft_len = min(r.draft_len, old_len + min(n, len(drafts)))
            r.tokens.extend(new)
            # Accepted drafts after an EOS are cut from the output, so they are not counted.
            self._commit(i, r, new, run.on_token, lambda: self._count(
                r.stats, len(drafts), min(n, len(r.tokens) - old_len)))
            if run.proposer is not None:  # finished rows too: the suffix cache keeps them
                run.proposer.extend(i, r.tokens[old_len:])

    @staticmethod
    def _count(st: RequestStats, drafted: int, accepted: int) -> None:
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
            r.stats.e2e_s = self.clock() - r.arrival
        if counted:
            counted()
        if on_token and emitted:
            on_token(r.index, emitted)

"""Replaying the decoding loop against known target outputs (what `tune` counts acceptance with).

Greedy decoding is deterministic, so once the target's greedy outputs for some prompts are
known, every proposer's behaviour on them can be re-run without the target model: the loop is
the real one, only the target's logits are read off the known tokens.
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from .engine import SpecDecoder
from .model_session import ModelSession
from .rows import LoopTimes, Row, new_row, prefill_calls
from .sampling import SamplingParams


def replay(decoder: SpecDecoder, prompts: list[list[int]], outputs: list[list[int]],
           max_new_tokens: int, k: int | None = None) -> tuple[list[Row], LoopTimes]:
    """Greedy decoding of `prompts` at K, with the target's greedy `outputs` already known.

    The loop is this decoder's own (`run_rows`: the same proposer or draft calls, verify
    windows, acceptance, stop rules and statistics); only the target model is not run:
    its logits are read off the known outputs (argmax at position p = token p + 1). For
    the target's true greedy outputs the rows' statistics (per-position acceptance, drafts,
    steps) and the draft calls are exactly those of `generate(..., k=k)`; target calls are
    counted, not timed. The proposer's state carries over as in `generate` (a suffix
    cache keeps these requests). Rows are decoded in groups of the compiled batch. It
    drives the draft session, so it must not run while the same sessions decode elsewhere.

    Proposers that read the target's own states (turbo heads, an EAGLE-3 head) cannot be fed
    from known tokens: for them the target itself is run, so the statistics are those of
    `generate(..., k=k)` by construction."""
    if len(prompts) != len(outputs):
        raise UsageError(f"{len(prompts)} prompts but {len(outputs)} outputs to replay")
    rows_all: list[Row] = []
    total = LoopTimes()
    reads_target = decoder.heads is not None or decoder.eagle3 is not None
    teacher = decoder if reads_target else KnownTarget(decoder)
    for start in range(0, len(prompts), decoder.batch):
        rows = [new_row(p, max_new_tokens, decoder.ctx_len, SamplingParams(), start + n)
                for n, p in enumerate(prompts[start:start + decoder.batch])]
        if isinstance(teacher, KnownTarget):
            teacher.known = {r.index: r.prompt + list(outputs[r.index]) for r in rows}
        times = teacher.run_rows(rows, k)
        for name in ("prefill_s", "draft_s", "target_s", "total_s", "target_calls",
                     "draft_calls"):
            setattr(total, name, getattr(total, name) + getattr(times, name))
        for w, n in times.windows.items():
            total.windows[w] = total.windows.get(w, 0) + n
        rows_all += rows
    return rows_all, total


class KnownTarget(SpecDecoder):
    """`replay`'s decoder: the base decoder's sessions, proposer and rules, with a
    target that answers from the known token sequences instead of running a model."""

    def __init__(self, base: SpecDecoder):
        super().__init__(base.target, base.draft, base.proposer, base.ks, base.prefill_len,
                         base.eos_ids, base.method, base.cb, draft_p_min=base.confidence_stop.p_min,
                         prefill_tails=base.prefill_tails, clock=base.clock)
        self.known: dict[int, list[int]] = {}  # row index -> prompt + output
        self._in_slot: dict[int, list[int]] = {}

    def _next(self, seq: list[int], p: int) -> int:
        """The target's greedy token after position p of a known sequence."""
        if p + 1 < len(seq):
            return seq[p + 1]
        if seq[-1] in self.eos_ids:  # past the end: the loop cuts whatever follows an EOS
            return seq[-1]
        raise UsageError(f"the replay needs the target's token after position {p}, past the "
                         "given output: give the target's full greedy output for "
                         "max_new_tokens")

    def _prefill(self, session: ModelSession, rows: list[Row], times: LoopTimes, kind: str,
                 slot: int | None = None) -> np.ndarray:
        if session is not self.target:
            return super()._prefill(session, rows, times, kind, slot)
        last = np.zeros((len(rows), session.vocab_size), np.float32)
        for i, r in enumerate(rows):
            seq = self.known[r.index]
            self._in_slot[slot if slot is not None else i] = seq
            last[i, self._next(seq, len(r.prompt) - 1)] = 1.0
        times.target_calls += prefill_calls([r.prompt for r in rows], self.prefill_len)
        return last

    def _call(self, session: ModelSession, ids: np.ndarray, pos: np.ndarray, times: LoopTimes,
              kind: str, batch_index: np.ndarray | None = None) -> np.ndarray:
        if session is not self.target:
            return super()._call(session, ids, pos, times, kind, batch_index)
        times.target_calls += 1
        logits = np.zeros((*ids.shape, session.vocab_size), np.float32)
        for b, s in zip(*np.nonzero(pos >= 0)):
            logits[b, s, self._next(self._in_slot[int(b)], int(pos[b, s]))] = 1.0
        return logits

"""The draft model's side of a step: bringing its KV up to date and proposing K tokens.

Each active row must enter the proposal calls with exactly one token the draft has not seen
(its last). A row that fully accepted is one token behind; a row that ran without speculation
for a while (the goodput gate) may be many behind: those tokens go through the draft's prefill
window, a chunk per call, instead of one call per token.

Confidence stop (`draft_p_min`, as llama.cpp's --draft-p-min): before a row takes the token of
position j, the draft's distribution for it is looked at; when its largest probability is below
the threshold, the row proposes nothing more this step. The decision depends only on the
draft's distribution, never on the token sampled from it, so speculative sampling stays exact.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from .policy import ConfidenceStop
from .rows import LoopTimes, Row, prefill_window
from .sampling import probabilities, sample
from .model_session import ModelSession


class DraftingDecoder(Protocol):
    """What the draft's side of a step needs of the decoder (engine.SpecDecoder is one): the
    prefill window, the confidence stop, the clock and the timed model call."""
    prefill_len: int
    prefill_tails: tuple[int, ...]
    cb: bool
    confidence_stop: ConfidenceStop
    clock: Callable[[], float]  # seconds (time.perf_counter; tests pass a clock of their own)

    def _call(self, session: ModelSession, ids: np.ndarray, pos: np.ndarray, times: LoopTimes,
              kind: str, batch_index: np.ndarray | None = None) -> np.ndarray: ...


def catch_up(dec: DraftingDecoder, draft: ModelSession, rows: list[Row], want: list[int],
             times: LoopTimes) -> None:
    """Feed each proposing row's unseen tokens (all but its last) to the draft."""
    behind = [i for i, r in enumerate(rows) if not r.done and want[i] > 0
              and r.draft_len < len(r.tokens) - 1]
    if any(len(rows[i].tokens) - 1 - rows[i].draft_len > 1 for i in behind):
        t0 = dec.clock()
        _catch_up_in_chunks(dec, draft, rows, behind, times)
        times.catch_up_s += dec.clock() - t0
        behind = [i for i in behind if rows[i].draft_len < len(rows[i].tokens) - 1]
    if behind:  # one token each: one decode call
        b = draft.batch_size
        ids, pos = np.zeros((b, 1), np.int64), np.full((b, 1), -1, np.int64)
        for i in behind:
            ids[i, 0], pos[i, 0] = rows[i].tokens[rows[i].draft_len], rows[i].draft_len
            rows[i].draft_len += 1
        dec._call(draft, ids, pos, times, "draft")


def _catch_up_in_chunks(dec: DraftingDecoder, draft: ModelSession, rows: list[Row],
                        behind: list[int], times: LoopTimes) -> None:
    """Prefill-window calls (the narrowest compiled one that holds what is left) over the
    rows' unseen tokens. A last chunk shorter than its window is moved left over tokens
    already seen (recomputing identical KV), so no padding is written after real tokens; with
    continuous batching each row goes alone into its slot."""
    p = dec.prefill_len
    groups = [[i] for i in behind] if dec.cb else [behind]
    for group in groups:
        b = 1 if dec.cb else draft.batch_size
        index = np.array([[group[0]]], np.int64) if dec.cb else None
        while any(rows[i].draft_len < len(rows[i].tokens) - 1 for i in group):
            w = prefill_window(max(len(rows[i].tokens) - 1 - rows[i].draft_len for i in group),
                               p, dec.prefill_tails)
            ids, pos = np.zeros((b, w), np.int64), np.full((b, w), -1, np.int64)
            for i in group:
                r = rows[i]
                end = min(r.draft_len + w, len(r.tokens) - 1)
                if r.draft_len >= end:
                    continue
                start = max(0, end - w)
                piece = r.tokens[start:end]
                row = 0 if dec.cb else i
                ids[row, :len(piece)] = piece
                pos[row, :len(piece)] = np.arange(start, end)
                r.draft_len = end
            dec._call(draft, ids, pos, times, "draft", index)
            times.catch_up_calls += 1


def propose(dec: DraftingDecoder, draft: ModelSession, rows: list[Row], want: list[int],
            times: LoopTimes) -> tuple[list[list[int]], list[list[np.ndarray]] | None]:
    """Up to want[i] draft tokens per row (fewer where the confidence stop ends a row), and
    the draft's distributions q of the sampled rows."""
    catch_up(dec, draft, rows, want, times)
    b = draft.batch_size
    proposals: list[list[int]] = [[] for _ in rows]
    q: list[list[np.ndarray]] = [[] for _ in rows]
    calls = [0] * len(rows)  # draft calls each row took part in this step
    drafting = [not r.done and want[i] > 0 for i, r in enumerate(rows)]
    for j in range(max(want, default=0)):
        if not any(drafting):
            break
        ids, pos = np.zeros((b, 1), np.int64), np.full((b, 1), -1, np.int64)
        for i, r in enumerate(rows):
            if drafting[i]:
                ids[i, 0] = proposals[i][-1] if j else r.tokens[-1]
                pos[i, 0] = len(r.tokens) - 1 + j
        logits = dec._call(draft, ids, pos, times, "draft")
        for i, r in enumerate(rows):
            if not drafting[i]:
                continue
            calls[i] += 1
            x = logits[i, 0]
            probs = None if r.sp.greedy else probabilities(x, r.sp)
            if dec.confidence_stop.stops(x, probs):
                drafting[i] = False  # not confident: this row stops proposing
                continue
            if probs is None:
                proposals[i].append(int(x.argmax()))
            else:
                q[i].append(probs)
                proposals[i].append(sample(probs, r.rng))
            if len(proposals[i]) >= want[i]:
                drafting[i] = False
    for i, r in enumerate(rows):
        if calls[i]:
            r.draft_len = len(r.tokens) - 1 + calls[i]  # every token the calls processed
    return proposals, q

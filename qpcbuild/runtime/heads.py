"""Proposals from turbo heads (export/turbo.py): no draft calls, the target's own last call.

Each verify call (and the prefill's last chunk) gives, beside the base model's logits, the
heads' logits at every kept position. After the target accepts, the row keeps those at its
last accepted token: head h there speaks for the token h + 1 places after the one the base
model samples next, so the next window is [that token, one proposal per head]. Greedy rows
propose each head's argmax; sampled rows draw each proposal from the head's distribution
under the row's own sampling settings, which is then the q the acceptance rule divides by
(speculative sampling stays exact for any q a proposal was really drawn from; here the heads'
proposals do not depend on each other).
"""

from __future__ import annotations

import numpy as np

from .rows import Row
from .sampling import probabilities, sample


def keep_head_logits(row: Row, head_logits: np.ndarray) -> None:
    """The heads' logits [heads, V] at the row's last accepted token, copied (the session's
    buffer is rewritten by its next call)."""
    row.head_logits = np.array(head_logits, dtype=np.float32)


def propose_from_heads(rows: list[Row], room: list[int]
                       ) -> tuple[list[list[int]], list[list[np.ndarray]] | None]:
    """Up to room[i] tokens per row from its kept head logits, and the distributions q of the
    sampled rows' proposals."""
    proposals: list[list[int]] = [[] for _ in rows]
    q: list[list[np.ndarray]] = [[] for _ in rows]
    for i, r in enumerate(rows):
        if r.done or r.head_logits is None:
            continue
        for x in r.head_logits[:room[i]]:
            if r.sp.greedy:
                proposals[i].append(int(x.argmax()))
            else:
                probs = probabilities(x, r.sp)
                q[i].append(probs)
                proposals[i].append(sample(probs, r.rng))
    return proposals, q

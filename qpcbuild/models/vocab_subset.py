"""A draft's vocabulary subset: the token ids whose rows its LM head keeps.

A small draft's cost is mostly its LM head (49,152 rows for SmolLM2). Keeping only the tokens a
draft will realistically propose (the most frequent ones in the target's own outputs) makes
each draft call read a fraction of those bytes. The graph still returns logits over the whole
vocabulary, with every token outside the subset at a large negative value, so the runtime, the
card's I/O and the acceptance rules are unchanged: such a draft simply never proposes those
tokens (its probability for them is 0, which rejection sampling allows), and the output stays
exactly the target's.

File format (JSON): {"token_ids": [int, ...], ...}; other keys are free-form notes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..errors import UsageError

MAX_FILE_BYTES = 16 << 20


def read_vocab_subset(path: Path, vocab_size: int, always: Iterable[int] = ()) -> np.ndarray:
    """Sorted unique int64 ids from `path`, plus `always` (the end-of-sequence ids, so a draft
    can still propose the end of an answer). Raises UsageError naming the file and the fault."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise UsageError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; a vocabulary "
                             "subset is a list of token ids")
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable JSON file ({exc})") from None
    ids = data.get("token_ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not ids:
        raise UsageError(f"{path}: expected an object with a non-empty list 'token_ids'")
    bad = next((v for v in ids if isinstance(v, bool) or not isinstance(v, int)
                or not 0 <= v < vocab_size), None)
    if bad is not None:
        raise UsageError(f"{path}: token id {bad!r} is not an integer in 0..{vocab_size - 1} "
                         "(the draft's vocab_size)")
    if len(set(ids)) != len(ids):
        raise UsageError(f"{path}: token_ids holds duplicates; the file looks damaged")
    out = np.unique(np.asarray([*ids, *always], dtype=np.int64))
    if len(out) >= vocab_size:
        raise UsageError(f"{path}: keeps every token of the vocabulary ({vocab_size}); remove "
                         "draft.vocab_subset instead")
    return out


def subset_digest(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()

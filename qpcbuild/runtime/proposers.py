"""Model-free draft proposers for speculative decoding, proposing exactly what vLLM's do.

Both guess the next tokens of a request from tokens already seen, so drafting costs no model
forward pass. The runtime loop drives them per batch row: ``start`` with the prompt,
``extend`` with every token sampled since (the first one included), ``propose`` before each
verification step, ``finish`` at the end. `ngram` is vLLM 0.32's ngram proposer and `suffix`
its suffix proposer (arctic-inference's SuffixDecodingCache), token for token; tests compare
both against proposals recorded from vLLM itself (tests/fixtures/vllm_proposals.json).

Calling ``start`` for an id that is already live finishes it first. ``extend``/``propose`` on
an unknown id raise ``KeyError`` because that is a bookkeeping bug in the caller; ``finish``
on an unknown id is a no-op so abort paths may call it unconditionally.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from ..recipe.schema import vllm_lookup_range
from .suffix_tree import PythonSuffixTree, SuffixTree

__all__ = ["Proposer", "NgramProposer", "SuffixProposer", "make_proposer"]


@runtime_checkable
class Proposer(Protocol):
    name: str

    def start(self, request_id: int, prompt: Sequence[int]) -> None: ...

    def extend(self, request_id: int, tokens: Sequence[int]) -> None: ...

    def propose(self, request_id: int, max_tokens: int) -> list[int]: ...

    def finish(self, request_id: int) -> None: ...


def _require_int(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; accepting True as "1" would hide config typos.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _require_float(name: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    # Rejects NaN and infinity too: floor(inf * match_len) would raise mid-decode.
    if not (math.isfinite(value) and low <= float(value) <= high):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return float(value)


# --------------------------------------------------------------------------- ngram

@dataclass
class _NgramState:
    tokens: list[int] = field(default_factory=list)
    # first_start[i] maps an n-gram (n = min + i) to its earliest start position, covering
    # only n-grams that are followed by at least one token.
    first_start: list[dict[tuple[int, ...], int]] = field(default_factory=list)


class NgramProposer:
    """Prompt lookup decoding as vLLM's ngram proposer does it: the longest n-gram (n in
    [prompt_lookup_min, prompt_lookup_max]) that ends the context and occurred before, at its
    EARLIEST occurrence, and up to max_tokens of what followed it there.

    Tables are updated incrementally (an n-gram's first occurrence never changes), so
    ``propose`` costs O(prompt_lookup_max - prompt_lookup_min) lookups at any context length.
    """

    name = "ngram"

    def __init__(self, prompt_lookup_min: int | None = None,
                 prompt_lookup_max: int | None = None) -> None:
        for key, value in (("prompt_lookup_min", prompt_lookup_min),
                           ("prompt_lookup_max", prompt_lookup_max)):
            if value is not None:
                _require_int(key, value, 1)
        lo, hi = vllm_lookup_range(prompt_lookup_min, prompt_lookup_max)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        self._states: dict[int, _NgramState] = {}

    def start(self, request_id: int, prompt: Sequence[int]) -> None:
        n_sizes = self.prompt_lookup_max - self.prompt_lookup_min + 1
        self._states[request_id] = _NgramState(first_start=[{} for _ in range(n_sizes)])
        # Same code path as generation so fresh and incremental states are identical.
        self.extend(request_id, prompt)

    def extend(self, request_id: int, tokens: Sequence[int]) -> None:
        state = self._states[request_id]
        seq = state.tokens
        for tok in tokens:
            end = len(seq)  # n-grams ending just before the new token now gain a continuation
            seq.append(int(tok))
            for i, table in enumerate(state.first_start):
                n = self.prompt_lookup_min + i
                if end >= n:
                    table.setdefault(tuple(seq[end - n:end]), end - n)

    def propose(self, request_id: int, max_tokens: int) -> list[int]:
        state = self._states[request_id]
        seq = state.tokens
        if max_tokens <= 0:
            return []
        length = len(seq)
        for n in range(self.prompt_lookup_max, self.prompt_lookup_min - 1, -1):
            if length <= n:  # need the suffix plus at least one earlier token
                continue
            pos = state.first_start[n - self.prompt_lookup_min].get(tuple(seq[length - n:]))
            if pos is not None:
                return seq[pos + n:pos + n + max_tokens]
        return []

    def finish(self, request_id: int) -> None:
        self._states.pop(request_id, None)


# -------------------------------------------------------------------------- suffix


@dataclass
class _Request:
    tokens: list[int]  # prompt + response so far
    local: PythonSuffixTree  # this request's prompt and response (or the C tree, alike)
    seq_id: int | None  # its response's id in the global tree (None: not cached)


class SuffixProposer:
    """Suffix decoding as vLLM's suffix proposer does it (arctic-inference's
    SuffixDecodingCache under vLLM's settings).

    Each live request has a tree of its own prompt and response; one global tree holds the
    responses (never prompts) of the last ``max_cached_requests`` requests started, live ones
    included, evicted oldest first. A proposal speculates from the last ``max_tree_depth``
    tokens in both trees (see suffix_tree.py) and keeps the higher-scoring draft (ties: the
    request's own tree). Request ids may be reused once finished: a finished request's
    response stays in the global tree under an id of its own.
    """

    name = "suffix"
    # The C tree where it is built (suffix_tree.IMPLEMENTATION); tests and benchmarks set the
    # Python one here to hold the two against each other.
    tree_class: type[PythonSuffixTree] = SuffixTree

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        self.max_tree_depth = _require_int("max_tree_depth", max_tree_depth, 1)
        self.max_cached_requests = _require_int("max_cached_requests", max_cached_requests, 0)
        self.max_spec_factor = _require_float("max_spec_factor", max_spec_factor, 0.0, math.inf)
        self.min_token_prob = _require_float("min_token_prob", min_token_prob, 0.0, 1.0)
        self._live: dict[int, _Request] = {}
        self._global = self.tree_class(self.max_tree_depth)
        self._cached: deque[int] = deque()  # global-tree seq ids, oldest first
        self._next_seq = 0

    @property
    def cached_requests(self) -> int:
        return len(self._cached)

    def start(self, request_id: int, prompt: Sequence[int]) -> None:
        self.finish(request_id)
        local = self.tree_class(self.max_tree_depth)
        local.extend(0, prompt)
        seq_id = None
        if self.max_cached_requests:
            seq_id, self._next_seq = self._next_seq, self._next_seq + 1
            self._cached.append(seq_id)
            while len(self._cached) > self.max_cached_requests:
                self._evict(self._cached.popleft())
        self._live[request_id] = _Request([int(t) for t in prompt], local, seq_id)

    def _evict(self, seq_id: int) -> None:
        if self._global.has(seq_id):
            self._global.remove(seq_id)
        for req in self._live.values():  # a live request evicted stops adding its response
            if req.seq_id == seq_id:
                req.seq_id = None

    def extend(self, request_id: int, tokens: Sequence[int]) -> None:
        req = self._live[request_id]
        tokens = [int(t) for t in tokens]
        req.tokens += tokens
        req.local.extend(0, tokens)
        if req.seq_id is not None:
            self._global.extend(req.seq_id, tokens)

    def propose(self, request_id: int, max_tokens: int) -> list[int]:
        req = self._live[request_id]
        if max_tokens <= 0:
            return []
        context = req.tokens[-self.max_tree_depth:]
        args = (max_tokens, self.max_spec_factor, 0.0, self.min_token_prob)
        # known_seq: the context ends with that sequence, whose suffix nodes the tree keeps
        own = req.local.speculate(context, *args, known_seq=0)
        cached = self._global.speculate(context, *args, known_seq=req.seq_id)
        return list((own if own.score >= cached.score else cached).token_ids)

    def finish(self, request_id: int) -> None:
        self._live.pop(request_id, None)


# ------------------------------------------------------------------------- factory

_FACTORIES: dict[str, Callable[..., Proposer]] = {
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
}
# Options go by vLLM's names everywhere (recipe, manifest, here); this table maps them to the
# constructors' argument names.
OPTION_NAMES: dict[str, dict[str, str]] = {
    "ngram": {"prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max"},
    "suffix": {f"suffix_decoding_{name}": name for name in
               ("max_tree_depth", "max_cached_requests", "max_spec_factor", "min_token_prob")},
}


def make_proposer(method: str, options: Mapping[str, Any] | None = None) -> Proposer:
    """Build a proposer by method name; options use vLLM's names (as in recipes)."""
    if method not in _FACTORIES:
        known = ", ".join(sorted(_FACTORIES))
        raise ValueError(f"unknown proposer method {method!r}; expected one of: {known}")
    opts = dict(options or {})
    names = OPTION_NAMES[method]
    unknown = sorted(set(opts) - set(names))
    if unknown:
        allowed = ", ".join(sorted(names))
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for proposer {method!r}; "
            f"allowed: {allowed}"
        )
    return _FACTORIES[method](**{names[k]: v for k, v in opts.items()})

"""Model-free draft proposers for speculative decoding.

Both proposers guess the next tokens of a request from text that has already
been seen, so drafting costs no model forward pass. The runtime loop drives
them per batch row: ``start`` with the prompt, ``extend`` with every token
accepted since, ``propose`` before each verification step, ``finish`` at end.

Calling ``start`` for an id that is already live replaces its state (the old
sequence is dropped, not cached). ``extend``/``propose`` on an unknown id raise
``KeyError`` because that is a bookkeeping bug in the caller; ``finish`` on an
unknown id is a no-op so abort paths may call it unconditionally.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

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
    # last_start[i] maps an n-gram (n = min + i) to its latest start position,
    # covering only n-grams that are followed by at least one token.
    last_start: list[dict[tuple[int, ...], int]] = field(default_factory=list)


class NgramProposer:
    """Prompt lookup decoding: copy what followed the latest earlier match of the suffix.

    Longer suffixes are tried first; for a given length the most recent earlier
    occurrence wins. Tables are updated incrementally so ``propose`` costs
    O(prompt_lookup_max**2) regardless of context length.
    """

    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        self.prompt_lookup_min = _require_int("prompt_lookup_min", prompt_lookup_min, 1)
        self.prompt_lookup_max = _require_int("prompt_lookup_max", prompt_lookup_max, 1)
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({prompt_lookup_max})"
            )
        self._states: dict[int, _NgramState] = {}

    def start(self, request_id: int, prompt: Sequence[int]) -> None:
        n_sizes = self.prompt_lookup_max - self.prompt_lookup_min + 1
        self._states[request_id] = _NgramState(last_start=[{} for _ in range(n_sizes)])
        # Same code path as generation so fresh and incremental states are identical.
        self.extend(request_id, prompt)

    def extend(self, request_id: int, tokens: Sequence[int]) -> None:
        state = self._states[request_id]
        seq = state.tokens
        for tok in tokens:
            end = len(seq)  # n-grams ending just before the new token now gain a continuation
            seq.append(int(tok))
            for i, table in enumerate(state.last_start):
                n = self.prompt_lookup_min + i
                if end >= n:
                    table[tuple(seq[end - n : end])] = end - n

    def propose(self, request_id: int, max_tokens: int) -> list[int]:
        state = self._states[request_id]
        seq = state.tokens
        if max_tokens <= 0:
            return []
        length = len(seq)
        for n in range(self.prompt_lookup_max, self.prompt_lookup_min - 1, -1):
            if length <= n:  # need the suffix plus at least one earlier token
                continue
            table = state.last_start[n - self.prompt_lookup_min]
            pos = table.get(tuple(seq[length - n :]))
            if pos is not None:
                return seq[pos + n : pos + n + max_tokens]
        return []

    def finish(self, request_id: int) -> None:
        self._states.pop(request_id, None)


# -------------------------------------------------------------------------- suffix


class _Node:
    __slots__ = ("count", "children")  # tries get large; slots roughly halve node size

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


def _lookup(root: _Node, path: Sequence[int]) -> _Node | None:
    node: _Node | None = root
    for tok in path:
        node = node.children.get(tok)
        if node is None:
            return None
    return node


def _add_sequence(root: _Node, seq: Sequence[int], depth: int, delta: int) -> None:
    """Add (delta=+1) or remove (delta=-1) every substring of ``seq`` up to ``depth`` tokens."""
    for i in range(len(seq)):
        node = root
        for tok in seq[i : i + depth]:
            child = node.children.get(tok)
            if child is None:
                if delta < 0:  # cannot happen when counts are consistent; stay safe
                    break
                child = node.children[tok] = _Node()
            child.count += delta
            if child.count <= 0:
                # A node's count bounds its subtree's counts, so the whole branch is dead.
                del node.children[tok]
                break
            node = child


@dataclass
class _SuffixState:
    tokens: list[int] = field(default_factory=list)
    root: _Node = field(default_factory=_Node)
    # Trie nodes of the context's suffixes of length 1..max_tree_depth-1, shortest first;
    # extending each by the next token indexes exactly the new substrings.
    active: list[_Node] = field(default_factory=list)


class SuffixProposer:
    """Suffix decoding over the live request plus a FIFO cache of finished requests.

    Every substring of at most ``max_tree_depth`` tokens is counted in a trie,
    one per live request and one shared for the cache; lookups sum both, so the
    trie depth bounds match length plus proposal length. The match is the
    longest context suffix with at least one recorded continuation (the
    context's own trailing occurrence never has one, but it does count towards
    the parent total used for probabilities). The walk takes the most
    frequent child; ties go to the smaller token id. It stops when the child's
    count / parent count drops below ``min_token_prob`` or after
    ``min(max_tokens, max(1, floor(max_spec_factor * match_len)))`` tokens.
    """

    name = "suffix"

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        # Depth 1 could hold a match but never a continuation, so it is useless.
        self.max_tree_depth = _require_int("max_tree_depth", max_tree_depth, 2)
        self.max_cached_requests = _require_int("max_cached_requests", max_cached_requests, 0)
        self.max_spec_factor = _require_float("max_spec_factor", max_spec_factor, 0.0, math.inf)
        self.min_token_prob = _require_float("min_token_prob", min_token_prob, 0.0, 1.0)
        self._states: dict[int, _SuffixState] = {}
        self._cache_root = _Node()
        self._cache: deque[tuple[int, ...]] = deque()

    @property
    def cached_requests(self) -> int:
        return len(self._cache)

    def start(self, request_id: int, prompt: Sequence[int]) -> None:
        self._states[request_id] = _SuffixState()
        self.extend(request_id, prompt)

    def extend(self, request_id: int, tokens: Sequence[int]) -> None:
        state = self._states[request_id]
        limit = self.max_tree_depth
        for tok in tokens:
            tok = int(tok)
            state.tokens.append(tok)
            new_active: list[_Node] = []
            # Parents have depths 0..len(active); children deeper than the limit are not kept.
            for parent in [state.root, *state.active]:
                child = parent.children.get(tok)
                if child is None:
                    child = parent.children[tok] = _Node()
                child.count += 1
                if len(new_active) + 1 < limit:
                    new_active.append(child)
            state.active = new_active

    def propose(self, request_id: int, max_tokens: int) -> list[int]:
        state = self._states[request_id]
        if max_tokens <= 0:
            return []
        match_len, nodes = self._longest_match(state)
        if match_len == 0:
            return []
        budget = min(max_tokens, max(1, math.floor(self.max_spec_factor * match_len)))
        out: list[int] = []
        while len(out) < budget:
            parent_count = sum(n.count for n in nodes)
            merged: dict[int, int] = {}
            for n in nodes:
                for tok, child in n.children.items():
                    merged[tok] = merged.get(tok, 0) + child.count
            if not merged:
                break
            tok, count = min(merged.items(), key=lambda kv: (-kv[1], kv[0]))
            if count < self.min_token_prob * parent_count:
                break
            out.append(tok)
            nodes = [n.children[tok] for n in nodes if tok in n.children]
        return out

    def finish(self, request_id: int) -> None:
        state = self._states.pop(request_id, None)
        if state is None or self.max_cached_requests == 0:
            return
        seq = tuple(state.tokens)
        _add_sequence(self._cache_root, seq, self.max_tree_depth, +1)
        self._cache.append(seq)
        while len(self._cache) > self.max_cached_requests:
            _add_sequence(self._cache_root, self._cache.popleft(), self.max_tree_depth, -1)

    def _longest_match(self, state: _SuffixState) -> tuple[int, list[_Node]]:
        """Longest context suffix with a continuation in either trie, and its nodes."""
        context = state.tokens
        roots = (state.root, self._cache_root)

        def nodes_for(k: int) -> list[_Node]:
            # Childless nodes are kept: their counts still belong in the parent total.
            found = (_lookup(r, context[len(context) - k :]) for r in roots)
            return [n for n in found if n is not None]

        # "Has a continuation" is monotone in k: if x+s is followed by c, so is s
        # (s+c is a shorter substring, hence also indexed). Binary search it.
        lo, hi = 0, min(len(context), self.max_tree_depth - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if any(n.children for n in nodes_for(mid)):
                lo = mid
            else:
                hi = mid - 1
        return lo, (nodes_for(lo) if lo else [])


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

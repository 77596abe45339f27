"""A counted suffix trie that proposes exactly what arctic-inference's SuffixTree proposes.

vLLM's `suffix` method drafts with arctic-inference's `SuffixDecodingCache` (a C++ suffix tree
with path compression). Its proposals are defined by four things, reproduced here on a plain
trie (one node per token; path compression changes memory, never counts or order):

- counts: every substring of at most `max_depth` tokens of every sequence is counted where it
  occurs (a node's count = occurrences of its string, also those with nothing after them);
- child order: children are kept by decreasing count, and equal counts are ordered by the tree's
  own update rules (a new child goes last; a child whose count grows moves in front of the
  first sibling with its predecessor's count; one whose count shrinks moves behind the last
  sibling with its old count). The walk always takes the first child, so ties go by this order;
- the walk: from the matched node, take the first child while the running product of
  child/parent count ratios stays >= min_token_prob, for at most
  int(match_len * max_spec_factor + max_spec_offset + 1e-6) tokens; its score is the sum of the
  running products. All of this in float32, as the C++ computes it: here each operation runs
  on Python floats (doubles) and is rounded to float32 after it, which gives the float32 result
  bit for bit (a double has more than 2 x 24 + 2 bits, so rounding twice cannot differ from
  rounding once for +, x and /);
- the match: every context suffix of length 1 .. len(context) - 1 that is in the tree is
  walked, and the highest score wins (ties: the longer match).

Storage: a node is an integer id into flat lists of integers (count, token, first and last
child, next and previous sibling: the sibling order is a doubly linked list), and the edges are
one dict from parent id and token to child id. A prompt of n tokens adds up to n x max_depth
nodes; as Python objects (a node, its children's dict and its order list each) they were more
than half of the cost of building and updating a tree, most of it the garbage collector
walking them. Integers are not tracked by the collector, and neither is a dict that holds only
integers.

The same tree in C, _suffix_tree.c (built by `pip install -e .` where a C compiler is found),
proposes bit for bit what this one does, at a fraction of the cost; `SuffixTree` is that one
when it is built, this one (`PythonSuffixTree`) otherwise or when the environment sets
QPCBUILD_PURE_PYTHON_SUFFIX=1. `IMPLEMENTATION` says which ("c" or "python").
"""

from __future__ import annotations

import functools
import os
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

_FLOAT32 = struct.Struct("f")
ROOT, NONE = 0, -1
_EDGE = 1 << 32  # an edge's key: parent id * _EDGE + token (token ids are below 2**32)


def f32(x: float) -> float:
    """x rounded to the nearest float32 (as a Python float)."""
    return float(_FLOAT32.unpack(_FLOAT32.pack(x))[0])


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0  # a float32 value
    match_len: int = 0


class PythonSuffixTree:
    """Sequences by id; substrings up to `max_depth` tokens counted in one trie."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        # per node id; the root (id 0) keeps no sibling order: a match is at least one token,
        # so its children are never walked, and theirs is the one list as long as the vocabulary
        self._count, self._token = [0], [NONE]
        self._first, self._last = [NONE], [NONE]  # children: the first is the one walked
        self._next, self._prev = [NONE], [NONE]  # siblings
        self._edges: dict[int, int] = {}  # parent id * _EDGE + token -> child id
        self._free: list[int] = []  # ids of removed nodes, reused
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, deque[int]] = {}  # nodes of the seq's suffixes being extended

    @property
    def node_count(self) -> int:
        """Nodes in the trie, the root not counted (ids of removed nodes are reused)."""
        return len(self._count) - len(self._free) - 1

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    __contains__ = has

    # ---------------------------------------------------------------- nodes
    def _new_child(self, parent: int, token: int) -> int:
        """A node of count 1 under `parent`, last among its siblings."""
        if self._free:
            node = self._free.pop()
            self._count[node], self._token[node] = 1, token
            self._first[node] = self._last[node] = self._next[node] = self._prev[node] = NONE
        else:
            node = len(self._count)
            self._count.append(1)
            self._token.append(token)
            self._first.append(NONE)
            self._last.append(NONE)
            self._next.append(NONE)
            self._prev.append(NONE)
        self._edges[parent * _EDGE + token] = node
        if parent != ROOT:
            tail = self._last[parent]
            if tail == NONE:
                self._first[parent] = node
            else:
                self._next[tail], self._prev[node] = node, tail
            self._last[parent] = node
        return node

    def _unlink(self, parent: int, node: int) -> None:
        before, after = self._prev[node], self._next[node]
        if before == NONE:
            self._first[parent] = after
        else:
            self._next[before] = after
        if after == NONE:
            self._last[parent] = before
        else:
            self._prev[after] = before
        self._prev[node] = self._next[node] = NONE

    def _insert_before(self, parent: int, node: int, at: int) -> None:
        """Put `node` in front of sibling `at` (NONE: last)."""
        if at == NONE:
            tail = self._last[parent]
            self._prev[node] = tail
            if tail == NONE:
                self._first[parent] = node
            else:
                self._next[tail] = node
            self._last[parent] = node
            return
        before = self._prev[at]
        self._prev[node], self._next[node], self._prev[at] = before, at, node
        if before == NONE:
            self._first[parent] = node
        else:
            self._next[before] = node

    def _grow(self, parent: int, child: int) -> None:
        """count += 1, moving the child as the C++ tree moves it in its sibling list."""
        count = self._count
        c, before = count[child], self._prev[child]
        if before != NONE and count[before] <= c + 1:
            target = count[before]
            at = self._first[parent]
            while count[at] != target:
                at = self._next[at]
            self._unlink(parent, child)
            self._insert_before(parent, child, at)
        count[child] = c + 1

    def _shrink(self, parent: int, child: int) -> None:
        """count -= 1 (count > 1), with the C++ tree's sibling reordering."""
        count = self._count
        c, after = count[child], self._next[child]
        if after != NONE and count[after] == c:
            self._unlink(parent, child)
            at = self._first[parent]
            while at != NONE and count[at] >= c:
                at = self._next[at]
            self._insert_before(parent, child, at)
        count[child] = c - 1

    def _drop(self, parent: int, node: int) -> None:
        """Remove `node` and everything under it."""
        if parent != ROOT:
            self._unlink(parent, node)
        del self._edges[parent * _EDGE + self._token[node]]
        stack = [node]
        while stack:
            n = stack.pop()
            child = self._first[n]
            while child != NONE:
                del self._edges[n * _EDGE + self._token[child]]
                stack.append(child)
                child = self._next[child]
            self._free.append(n)

    # ---------------------------------------------------------------- sequences
    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, deque())
        count, edges, first, last = self._count, self._edges, self._first, self._last
        token, nxt, prev, free = self._token, self._next, self._prev, self._free
        for tok in tokens:
            tok = int(tok)
            if not 0 <= tok < _EDGE:
                raise ValueError(f"token id {tok} is outside 0 .. 2**32 - 1")
            active.append(ROOT)
            count[ROOT] += 1
            if len(active) > self.max_depth:
                active.popleft()
            seq.append(tok)
            for i, node in enumerate(active):
                key = node * _EDGE + tok
                child = edges.get(key)
                if child is None:
                    if node != ROOT and first[node] == NONE and not free:
                        # the commonest new node, a node's first child with no freed id
                        # to reuse: what _new_child does, without the call
                        child = first[node] = last[node] = len(count)
                        count.append(1)
                        token.append(tok)
                        first.append(NONE)
                        last.append(NONE)
                        nxt.append(NONE)
                        prev.append(NONE)
                        edges[key] = child
                    else:
                        child = self._new_child(node, tok)
                elif node == ROOT or first[node] == child:  # no sibling moves
                    count[child] += 1
                else:
                    self._grow(node, child)
                active[i] = child

    def remove(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        self._active.pop(seq_id, None)
        count, edges = self._count, self._edges
        for start in range(len(seq)):
            node = ROOT
            count[ROOT] -= 1
            for tok in seq[start:start + self.max_depth]:
                child = edges.get(node * _EDGE + tok)
                if child is None:
                    break
                if count[child] > 1:
                    if node == ROOT:
                        count[child] -= 1
                    else:
                        self._shrink(node, child)
                else:  # this sequence was its only occurrence: the whole branch goes
                    self._drop(node, child)
                    break
                node = child

    def _match(self, context: Sequence[int]) -> int | None:
        node, edges = ROOT, self._edges
        for tok in context:
            child = edges.get(node * _EDGE + tok)
            if child is None:
                return None
            node = child
        return node

    def suffix_nodes(self, seq_id: int) -> Sequence[int]:
        """The nodes of a sequence's last suffixes, longest first (the one of length m is
        [-m]): where a context that ends that sequence matches, without walking from the root."""
        return self._active.get(seq_id, ())

    # ---------------------------------------------------------------- proposals
    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  max_spec_offset: float, min_token_prob: float,
                  known: Sequence[int] = (), known_seq: int | None = None) -> Draft:
        """`known`: `suffix_nodes` of a sequence the context ends with (a shortcut only);
        `known_seq`: that sequence's id, the same shortcut (the C tree's without a tuple)."""
        if known_seq is not None:
            known = self._active.get(known_seq, ())
        count, first = self._count, self._first
        pack, unpack = _FLOAT32.pack, _FLOAT32.unpack
        best, best_score, best_len, best_tokens = None, 0.0, 0, 0
        min_p = f32(min_token_prob)
        for match_len in range(1, len(context)):
            node = known[-match_len] if match_len <= len(known) else \
                self._match(context[len(context) - match_len:])
            if node is None:
                break
            length = max(0, min(max_spec_tokens, _cap(match_len, max_spec_factor,
                                                       max_spec_offset)))
            # The walk's score only (the winner's tokens are collected once, below): most
            # walks end after a step or two, and building each one's lists cost more.
            prob, score, steps, at = 1.0, 0.0, 0, node
            while steps < length:
                child = first[at]
                if child == NONE:
                    break
                # f32(prob * f32(ratio)) and f32(score + prob), spelled out: the hottest line
                prob = unpack(pack(prob * unpack(pack(count[child] / count[at]))[0]))[0]
                if prob < min_p:
                    break
                score = unpack(pack(score + prob))[0]
                steps, at = steps + 1, child
            if score >= best_score:  # ties: the longer match
                best, best_score, best_len, best_tokens = node, score, match_len, length
        if best is None:
            return Draft()
        tokens, probs, score = self._walk(best, best_tokens, min_p)
        return Draft(tokens, probs, score, best_len)

    def _walk(self, node: int, max_tokens: int, min_p: float
              ) -> tuple[list[int], list[float], float]:
        """From `node`, the first child while the running probability stays >= min_p: (tokens,
        their running probabilities, the score), all float32 values."""
        count, first, token = self._count, self._first, self._token
        tokens: list[int] = []
        probs: list[float] = []
        prob, score = 1.0, 0.0
        while len(tokens) < max_tokens:
            child = first[node]
            if child == NONE:
                break
            prob = f32(prob * f32(count[child] / count[node]))
            if prob < min_p:
                break
            tokens.append(token[child])
            probs.append(prob)
            score = f32(score + prob)
            node = child
        return tokens, probs, score


@functools.lru_cache(maxsize=4096)
def _cap(match_len: int, factor: float, offset: float) -> int:
    """int(match_len * factor + offset + 1e-6), the products in float32 as the C++ has them."""
    return int(f32(f32(match_len * f32(factor)) + f32(offset)) + 1e-6)


def _native_class() -> type[PythonSuffixTree] | None:
    """The C tree, or None where it is not built (or not loadable, e.g. built for another
    Python); speculate returns this module's Draft from it."""
    try:
        from ._suffix_tree import SuffixTree as native, set_draft_type
    except ImportError:
        return None
    set_draft_type(Draft)
    # typed as the Python tree: the C one has its methods and answers (test_suffix_tree_native)
    return cast("type[PythonSuffixTree]", native)


NativeSuffixTree = _native_class()
# Any value but "" and "0" keeps the Python tree (tests, benchmarks, a suspected native bug).
_PURE_PYTHON = os.environ.get("QPCBUILD_PURE_PYTHON_SUFFIX", "") not in ("", "0")
SuffixTree: type[PythonSuffixTree] = \
    PythonSuffixTree if NativeSuffixTree is None or _PURE_PYTHON else NativeSuffixTree
IMPLEMENTATION = "python" if SuffixTree is PythonSuffixTree else "c"

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
  rounding once for +, x and /); a proposal costs 0.42x of what it did on numpy's
  float32 scalars;
- the match: every context suffix of length 1 .. len(context) - 1 that is in the tree is
  walked, and the highest score wins (ties: the longer match).
"""

from __future__ import annotations

import functools
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_FLOAT32 = struct.Struct("f")


def f32(x: float) -> float:
    """x rounded to the nearest float32 (as a Python float)."""
    return _FLOAT32.unpack(_FLOAT32.pack(x))[0]


class _Node:
    __slots__ = ("count", "token", "children", "order")

    def __init__(self, token: int) -> None:
        self.count = 0
        self.token = token
        self.children: dict[int, _Node] = {}
        self.order: list[_Node] = []  # the children, first = the one the walk takes


def _grow(parent: _Node, child: _Node) -> None:
    """child.count += 1, keeping parent.order as the C++ tree keeps its sibling list."""
    order, c = parent.order, child.count
    i = order.index(child)
    if i > 0 and order[i - 1].count <= c + 1:
        prev_count = order[i - 1].count
        j = next(n for n, node in enumerate(order) if node.count == prev_count)
        del order[i]
        order.insert(j, child)
    child.count = c + 1


def _shrink(parent: _Node, child: _Node) -> None:
    """child.count -= 1 (child.count > 1), with the C++ tree's sibling reordering."""
    order, c = parent.order, child.count
    i = order.index(child)
    if i + 1 < len(order) and order[i + 1].count == c:
        del order[i]
        j = next((n for n, node in enumerate(order) if node.count < c), len(order))
        order.insert(j, child)
    child.count = c - 1


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0  # a float32 value
    match_len: int = 0


class SuffixTree:
    """Sequences by id; substrings up to `max_depth` tokens counted in one trie."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1)
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, deque[_Node]] = {}  # nodes of the seq's suffixes being extended

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, deque())
        root = self.root
        for tok in tokens:
            tok = int(tok)
            active.append(root)
            root.count += 1
            if len(active) > self.max_depth:
                active.popleft()
            seq.append(tok)
            for i, node in enumerate(active):
                child = node.children.get(tok)
                # The root's child order is never walked (a match is at least one token), so
                # it is not kept: it is the one list as long as the vocabulary.
                if child is None:
                    child = node.children[tok] = _Node(tok)
                    child.count = 1
                    if node is not root:
                        node.order.append(child)
                elif node is root:
                    child.count += 1
                else:
                    _grow(node, child)
                active[i] = child

    def remove(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id)
        self._active.pop(seq_id, None)
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for tok in seq[start:start + self.max_depth]:
                child = node.children.get(tok)
                if child is None:
                    break
                if child.count > 1:
                    if node is self.root:
                        child.count -= 1
                    else:
                        _shrink(node, child)
                else:  # this sequence was its only occurrence: the whole branch goes
                    if node is not self.root:
                        node.order.remove(child)
                    del node.children[tok]
                    break
                node = child

    def _match(self, context: Sequence[int]) -> _Node | None:
        node = self.root
        for tok in context:
            node = node.children.get(tok)
            if node is None:
                return None
        return node

    def suffix_nodes(self, seq_id: int) -> Sequence[_Node]:
        """The nodes of a sequence's last suffixes, longest first (the one of length m is
        [-m]): where a context that ends that sequence matches, without walking from the root."""
        return self._active.get(seq_id, ())

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  max_spec_offset: float, min_token_prob: float,
                  known: Sequence[_Node] = ()) -> Draft:
        """`known`: `suffix_nodes` of a sequence the context ends with (a shortcut only)."""
        best, best_score, best_len = None, 0.0, 0
        min_p = f32(min_token_prob)
        for match_len in range(1, len(context)):
            node = known[-match_len] if match_len <= len(known) else \
                self._match(context[len(context) - match_len:])
            if node is None:
                break
            cap = _cap(match_len, max_spec_factor, max_spec_offset)
            walk = _walk(node, max(0, min(max_spec_tokens, cap)), min_p)
            if walk[2] >= best_score:  # ties: the longer match
                best, best_score, best_len = walk, walk[2], match_len
        if best is None:
            return Draft()
        return Draft(best[0], best[1], best_score, best_len)


def _walk(node: _Node, max_tokens: int, min_p: float) -> tuple[list[int], list[float], float]:
    """From `node`, the first child while the running probability stays >= min_p: (tokens,
    their running probabilities, the score), all float32 values."""
    tokens: list[int] = []
    probs: list[float] = []
    prob, score = 1.0, 0.0
    while len(tokens) < max_tokens and node.order:
        child = node.order[0]
        prob = f32(prob * f32(child.count / node.count))
        if prob < min_p:
            break
        tokens.append(child.token)
        probs.append(prob)
        score = f32(score + prob)
        node = child
    return tokens, probs, score


@functools.lru_cache(maxsize=4096)
def _cap(match_len: int, factor: float, offset: float) -> int:
    """int(match_len * factor + offset + 1e-6), the products in float32 as the C++ has them."""
    return int(f32(f32(match_len * f32(factor)) + f32(offset)) + 1e-6)

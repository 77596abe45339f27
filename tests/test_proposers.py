"""Tests for the model-free draft proposers (prompt lookup and suffix decoding)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qpcbuild.runtime.proposers import NgramProposer, Proposer, SuffixProposer, make_proposer

# ------------------------------------------------------------ brute-force references


def ref_ngram(seq: Sequence[int], lo: int, hi: int, k: int) -> list[int]:
    """Scan every earlier position; obviously correct, O(context * n)."""
    seq = list(seq)
    if k <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        if len(seq) <= n:
            continue
        suffix = seq[len(seq) - n :]
        for pos in range(len(seq) - n - 1, -1, -1):
            if seq[pos : pos + n] == suffix:
                return seq[pos + n : pos + n + k]
    return []


def ref_suffix(context, cached, depth: int, factor: float, min_prob: float, k: int) -> list[int]:
    """Suffix decoding computed from raw occurrence counts instead of a trie."""
    seqs = [tuple(s) for s in cached] + [tuple(context)]

    def count(s: tuple[int, ...]) -> int:
        return sum(q[i : i + len(s)] == s for q in seqs for i in range(len(q) - len(s) + 1))

    def continuations(s: tuple[int, ...]) -> Counter[int]:
        if len(s) + 1 > depth:  # the trie only stores substrings up to `depth`
            return Counter()
        n = len(s)
        return Counter(q[i + n] for q in seqs for i in range(len(q) - n) if q[i : i + n] == s)

    if k <= 0:
        return []
    match = 0
    for m in range(min(len(context), depth - 1), 0, -1):
        if continuations(tuple(context[len(context) - m :])):
            match = m
            break
    if match == 0:
        return []
    budget = min(k, max(1, math.floor(factor * match)))
    s = tuple(context[len(context) - match :])
    out: list[int] = []
    while len(out) < budget:
        cont = continuations(s)
        if not cont:
            break
        tok, cnt = min(cont.items(), key=lambda kv: (-kv[1], kv[0]))
        if cnt < min_prob * count(s):
            break
        out.append(tok)
        s = s + (tok,)
    return out


def ngram(seq: Sequence[int], k: int, lo: int = 1, hi: int = 4) -> list[int]:
    p = NgramProposer(prompt_lookup_min=lo, prompt_lookup_max=hi)
    p.start(0, seq)
    return p.propose(0, k)


# ------------------------------------------------------------------------- ngram


def test_ngram_prefers_longest_matching_suffix_over_more_recent_shorter_one():
    seq = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert ngram(seq, 3, lo=1, hi=3) == [9, 5, 3]  # trigram "1 2 3" at 0
    assert ngram(seq, 3, lo=1, hi=1) == [7, 1, 2]  # unigram "3" most recently at 5


def test_ngram_chooses_most_recent_earlier_occurrence():
    assert ngram([1, 5, 1, 6, 1], 2, lo=1, hi=1) == [6, 1]


def test_ngram_no_proposal_without_earlier_match():
    assert ngram([1, 2, 3, 4], 5) == []
    assert ngram([], 5) == []
    assert ngram([7], 5) == []


def test_ngram_proposal_capped_by_max_tokens_and_end_of_context():
    seq = [1, 2, 3, 1]
    assert ngram(seq, 10) == [2, 3, 1]
    assert ngram(seq, 2) == [2, 3]
    assert ngram(seq, 0) == []


def test_ngram_overlapping_occurrence_is_a_valid_match():
    assert ngram([7, 7, 7], 4, lo=2, hi=2) == [7]


def test_ngram_respects_prompt_lookup_min():
    # Only a unigram repeats, so with min=2 there is nothing to propose.
    assert ngram([1, 2, 3, 1], 3, lo=2, hi=4) == []


def test_ngram_extend_updates_tables_for_generated_tokens():
    p = NgramProposer()
    p.start(0, [4, 5, 6])
    assert p.propose(0, 2) == []
    p.extend(0, [4])
    assert p.propose(0, 2) == [5, 6]
    p.extend(0, [5, 6, 8])
    assert p.propose(0, 2) == []


def test_ngram_requests_are_independent_and_finish_frees_state():
    p = NgramProposer()
    p.start(1, [1, 2, 1])
    p.start(2, [3, 4, 3])
    assert p.propose(1, 1) == [2]
    assert p.propose(2, 1) == [4]
    p.finish(1)
    p.finish(1)  # idempotent: abort paths may finish twice
    with pytest.raises(KeyError):
        p.propose(1, 1)
    with pytest.raises(KeyError):
        p.extend(3, [1])


@settings(max_examples=80, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), max_size=20),
    chunks=st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=5),
    lo=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(0, 6),
)
def test_ngram_incremental_extend_matches_fresh_start_and_reference(prompt, chunks, lo, extra, k):
    hi = lo + extra
    inc = NgramProposer(lo, hi)
    inc.start(0, prompt)
    seq = list(prompt)
    for chunk in chunks:
        inc.extend(0, chunk)
        seq += chunk
        assert inc.propose(0, k) == ref_ngram(seq, lo, hi, k)
    fresh = NgramProposer(lo, hi)
    fresh.start(0, seq)
    assert fresh.propose(0, k) == inc.propose(0, k) == ref_ngram(seq, lo, hi, k)


# ------------------------------------------------------------------------ suffix


def suffix(seq: Sequence[int], k: int, **kw) -> list[int]:
    p = SuffixProposer(**kw)
    p.start(0, seq)
    return p.propose(0, k)


def test_suffix_proposes_repeated_continuation():
    # Match "1 2" (m=2) allows 2 tokens at max_spec_factor=1.
    assert suffix([1, 2, 3, 4, 5, 1, 2], 8) == [3, 4]


def test_suffix_max_spec_factor_scales_length_with_match_length():
    seq = [1, 2, 3, 4, 5, 1, 2]  # m = 2
    assert suffix(seq, 8, max_spec_factor=2.0) == [3, 4, 5, 1]
    assert suffix(seq, 8, max_spec_factor=0.5) == [3]
    assert suffix(seq, 8, max_spec_factor=0.0) == [3]  # a match always allows one token
    assert suffix(seq, 3, max_spec_factor=2.0) == [3, 4, 5]  # max_tokens still caps


def test_suffix_no_proposal_without_match():
    assert suffix([1, 2, 3], 4) == []
    assert suffix([], 4) == []
    assert suffix([1, 2, 1], 0) == []


def test_suffix_max_tree_depth_bounds_match_plus_proposal():
    seq = [1, 2, 3, 4, 1, 2]
    assert suffix(seq, 8, max_tree_depth=24) == [3, 4]
    assert suffix(seq, 8, max_tree_depth=3) == [3]  # "1 2 3" is the deepest node


def test_suffix_ties_go_to_smaller_token_id_and_threshold_applies():
    seq = [7, 8, 3, 7, 8, 1, 7, 8, 2, 7, 8]  # "7 8" -> 1, 2, 3 each with p = 1/4
    assert suffix(seq, 8, min_token_prob=0.25) == [1, 7]
    assert suffix(seq, 8, min_token_prob=0.3) == []


def with_cache(finished: Sequence[Sequence[int]], live: Sequence[int], **kw) -> SuffixProposer:
    """Proposer whose cache holds ``finished`` (oldest first) and request 0 = ``live``."""
    p = SuffixProposer(**kw)
    for rid, seq in enumerate(finished, start=100):
        p.start(rid, seq)
        p.finish(rid)
    p.start(0, live)
    return p


def test_suffix_branch_below_min_token_prob_stops_walk():
    cache = [[1, 2, 5], [1, 2, 6], [1, 2, 7]]
    # "1" -> 2 has p = 3/4; "1 2" splits three ways (p = 1/3) so the walk stops there.
    assert with_cache(cache, [1], max_spec_factor=4.0, min_token_prob=0.5).propose(0, 4) == [2]
    assert with_cache(cache, [1], max_spec_factor=4.0, min_token_prob=0.3).propose(0, 4) == [2, 5]


def test_suffix_probability_counts_live_occurrence_without_continuation():
    # Cache "0 0": "0" seen twice, once followed by 0. The live "0" adds a third
    # occurrence, so p(0 | 0) = 1/3, below the 0.5 threshold.
    assert with_cache([[0, 0]], [0], max_tree_depth=2, min_token_prob=0.5).propose(0, 1) == []
    assert with_cache([[0, 0]], [0], max_tree_depth=2, min_token_prob=0.3).propose(0, 1) == [0]


def test_suffix_uses_cross_request_cache_after_finish():
    p = SuffixProposer()
    p.start(1, [10, 11, 12, 13, 14])
    p.start(2, [10, 11])
    assert p.propose(2, 4) == []  # live requests do not see each other
    p.finish(1)
    assert p.propose(2, 4) == [12, 13]
    assert p.cached_requests == 1


def test_suffix_cache_disabled_when_max_cached_requests_is_zero():
    p = with_cache([[10, 11, 12, 13, 14]], [10, 11], max_cached_requests=0)
    assert p.propose(0, 4) == []
    assert p.cached_requests == 0


def test_suffix_cache_evicts_oldest_request_first():
    p = with_cache([[10, 11, 12], [20, 21, 22]], [10, 11], max_cached_requests=1)
    assert p.propose(0, 2) == []  # the older request was evicted
    p.start(4, [20, 21])
    assert p.propose(4, 2) == [22]
    assert with_cache([[10, 11, 12], [20, 21, 22]], [10, 11], max_cached_requests=2).propose(
        0, 2
    ) == [12]
    # Eviction must remove the evicted request's nodes, not leave zero-count ones.
    assert set(p._cache_root.children) == {20, 21, 22}


def test_suffix_restart_discards_previous_state_without_caching_it():
    p = SuffixProposer()
    p.start(1, [1, 2, 3])
    p.start(1, [4, 5])
    p.extend(1, [4])
    assert p.propose(1, 2) == [5]
    assert p.cached_requests == 0


@settings(max_examples=80, deadline=None)
@given(
    cached=st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=4),
    max_cached=st.integers(0, 3),
    prompt=st.lists(st.integers(0, 3), max_size=12),
    chunks=st.lists(st.lists(st.integers(0, 3), max_size=4), max_size=4),
    depth=st.integers(2, 6),
    factor=st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0]),
    min_prob=st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]),
    k=st.integers(0, 6),
)
def test_suffix_incremental_extend_matches_fresh_start_and_reference(
    cached, max_cached, prompt, chunks, depth, factor, min_prob, k
):
    kw = dict(max_tree_depth=depth, max_cached_requests=max_cached)
    kw.update(max_spec_factor=factor, min_token_prob=min_prob)
    kept = cached[max(0, len(cached) - max_cached) :] if max_cached else []  # FIFO survivors
    inc = with_cache(cached, prompt, **kw)
    seq = list(prompt)
    assert inc.propose(0, k) == ref_suffix(seq, kept, depth, factor, min_prob, k)
    for chunk in chunks:
        inc.extend(0, chunk)
        seq += chunk
        assert inc.propose(0, k) == ref_suffix(seq, kept, depth, factor, min_prob, k)
    assert with_cache(cached, seq, **kw).propose(0, k) == inc.propose(0, k)


# ------------------------------------------------------- validation and factory


@pytest.mark.parametrize(
    "kwargs",
    [{"prompt_lookup_min": 0}, {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
     {"prompt_lookup_max": -1}, {"prompt_lookup_min": 1.5}, {"prompt_lookup_max": True}],
)
def test_ngram_rejects_bad_constructor_args(kwargs):
    with pytest.raises(ValueError, match="prompt_lookup"):
        NgramProposer(**kwargs)


@pytest.mark.parametrize(
    ("name", "value"),
    [("max_tree_depth", 0), ("max_tree_depth", 1), ("max_cached_requests", -1),
     ("max_spec_factor", -0.5), ("max_spec_factor", math.nan), ("max_spec_factor", math.inf),
     ("min_token_prob", 1.5), ("min_token_prob", -0.1), ("min_token_prob", "0.2")],
)
def test_suffix_rejects_bad_constructor_args(name, value):
    with pytest.raises(ValueError, match=name):
        SuffixProposer(**{name: value})


def test_make_proposer_builds_each_method_with_options():
    ng = make_proposer("ngram", {"prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert isinstance(ng, NgramProposer) and isinstance(ng, Proposer)
    assert (ng.name, ng.prompt_lookup_min, ng.prompt_lookup_max) == ("ngram", 2, 3)
    sx = make_proposer("suffix", {"suffix_decoding_max_tree_depth": 8,
                                  "suffix_decoding_min_token_prob": 0.2})
    assert isinstance(sx, SuffixProposer) and isinstance(sx, Proposer)
    assert (sx.name, sx.max_tree_depth, sx.min_token_prob) == ("suffix", 8, 0.2)
    assert isinstance(make_proposer("suffix", {}), SuffixProposer)


def test_make_proposer_rejects_unknown_method_and_option_by_name():
    with pytest.raises(ValueError, match="'eagle'"):
        make_proposer("eagle", {})
    with pytest.raises(ValueError, match="'max_tree_depth'"):
        make_proposer("ngram", {"max_tree_depth": 4})
    with pytest.raises(ValueError, match="'prompt_lookup_min'"):
        make_proposer("suffix", {"prompt_lookup_min": 1})

"""Tests for the model-free draft proposers (prompt lookup and suffix decoding): hand-worked
cases and properties here; token-for-token agreement with vLLM's own proposers in
test_vllm_proposers.py."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qpcbuild.runtime.proposers import (NgramProposer, Proposer, SuffixProposer, make_proposer,
                                        vllm_lookup_range)

# ------------------------------------------------------------ brute-force reference


def ref_ngram(seq: Sequence[int], lo: int, hi: int, k: int) -> list[int]:
    """Scan every earlier position, earliest first; obviously correct, O(context * n)."""
    seq = list(seq)
    if k <= 0:
        return []
    for n in range(hi, lo - 1, -1):
        if len(seq) <= n:
            continue
        suffix = seq[len(seq) - n :]
        for pos in range(0, len(seq) - n):
            if seq[pos : pos + n] == suffix:
                return seq[pos + n : pos + n + k]
    return []


def ngram(seq: Sequence[int], k: int, lo: int | None = 1, hi: int | None = 4) -> list[int]:
    p = NgramProposer(prompt_lookup_min=lo, prompt_lookup_max=hi)
    p.start(0, seq)
    return p.propose(0, k)


# ------------------------------------------------------------------------- ngram


def test_ngram_prefers_longest_matching_suffix_over_a_shorter_one():
    seq = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert ngram(seq, 3, lo=1, hi=3) == [9, 5, 3]  # trigram "1 2 3" at 0
    assert ngram(seq, 3, lo=1, hi=1) == [9, 5, 3]  # unigram "3" first at 2


def test_ngram_chooses_the_earliest_occurrence_as_vllm_does():
    assert ngram([1, 5, 1, 6, 1], 2, lo=1, hi=1) == [5, 1]
    # vLLM 0.32's own examples (shared/reference/vllm-cpu.md)
    assert ngram([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 3, lo=1, hi=3) == [4, 1, 2]
    assert ngram([5, 5, 5, 5], 3, lo=1, hi=3) == [5]
    assert ngram([1, 2, 1, 3, 1], 2, lo=1, hi=1) == [2, 1]


def test_ngram_options_resolve_as_vllm_resolves_them():
    assert vllm_lookup_range(None, None) == (5, 5)
    assert vllm_lookup_range(2, None) == (2, 2)
    assert vllm_lookup_range(None, 3) == (3, 3)
    p = NgramProposer()
    assert (p.prompt_lookup_min, p.prompt_lookup_max) == (5, 5)
    # the default needs a 5-gram: a repeated 4-gram proposes nothing
    assert ngram([1, 2, 3, 4, 9, 1, 2, 3, 4], 3, lo=None, hi=None) == []
    assert ngram([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5], 3, lo=None, hi=None) == [9, 1, 2]


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
    p = NgramProposer(1, 4)
    p.start(0, [4, 5, 6])
    assert p.propose(0, 2) == []
    p.extend(0, [4])
    assert p.propose(0, 2) == [5, 6]
    p.extend(0, [5, 6, 8])
    assert p.propose(0, 2) == []


def test_ngram_requests_are_independent_and_finish_frees_state():
    p = NgramProposer(1, 4)
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


def test_suffix_proposes_the_best_scoring_continuation():
    # "1 2" (match 2) allows 2 tokens at max_spec_factor 1: 3 (p 1/2), then 4 (p 1/2 x 1)
    assert suffix([1, 2, 3, 4, 5, 1, 2], 8) == [3, 4]


def test_suffix_max_spec_factor_scales_length_with_match_length():
    seq = [1, 2, 3, 4, 5, 1, 2]  # longest match 2
    assert suffix(seq, 8, max_spec_factor=2.0) == [3, 4, 5, 1]
    assert suffix(seq, 8, max_spec_factor=0.5) == [3]  # int(2 * 0.5) = 1
    assert suffix(seq, 8, max_spec_factor=0.25) == []  # int(2 * 0.25) = 0: no token at all
    assert suffix(seq, 3, max_spec_factor=2.0) == [3, 4, 5]  # max_tokens still caps


def test_suffix_no_proposal_without_match():
    assert suffix([1, 2, 3], 4) == []
    assert suffix([], 4) == []
    assert suffix([1, 2, 1], 0) == []


def test_suffix_probability_is_the_running_product_and_ties_keep_insertion_order():
    # "7 8" is followed by 3, 1 and 2 once each and once by nothing: each has p 1/4. Equal
    # counts stay in the order they were first seen, so the walk takes 3, not the smallest id.
    seq = [7, 8, 3, 7, 8, 1, 7, 8, 2, 7, 8]
    assert suffix(seq, 8, min_token_prob=0.25) == [3, 7]
    assert suffix(seq, 8, min_token_prob=0.3) == []
    # running product: "1 2" (3 times) -> 3 twice: 2/3; "1 2 3" -> 4 or 5: 2/3 x 1/2 = 1/3
    seq = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    assert suffix(seq, 3, min_token_prob=0.3) == [3, 4]
    assert suffix(seq, 3, min_token_prob=0.34) == [3]
    assert suffix(seq, 3, min_token_prob=0.7) == []


def test_suffix_live_requests_see_each_others_responses_but_not_prompts():
    p = SuffixProposer()
    p.start(1, [10, 11, 12, 13, 14])  # a prompt: only request 1 sees it
    p.start(2, [10, 11])
    assert p.propose(2, 4) == []
    p.extend(1, [20, 21, 22, 23])  # a response: every request sees it at once
    p.start(3, [5, 20, 21])  # (the whole context is never a match: 5 is only a lead-in)
    assert p.propose(3, 4) == [22, 23]
    p.finish(1)
    p.finish(3)
    p.start(4, [5, 20, 21])  # finished requests' responses stay cached
    assert p.propose(4, 4) == [22, 23]
    assert p.cached_requests == 4


def test_suffix_cache_disabled_when_max_cached_requests_is_zero():
    p = SuffixProposer(max_cached_requests=0)
    p.start(1, [5])
    p.extend(1, [10, 11, 12, 13, 14])
    p.finish(1)
    p.start(0, [10, 11])
    assert p.propose(0, 4) == []
    assert p.cached_requests == 0


def test_suffix_cache_evicts_the_oldest_started_request_first():
    p = SuffixProposer(max_cached_requests=2)
    for rid, response in ((1, [10, 11, 12]), (2, [20, 21, 22])):
        p.start(rid, [0])
        p.extend(rid, response)
    p.start(3, [10, 11])  # a third request pushes request 1's response out, live or not
    assert p.propose(3, 2) == []
    p.start(4, [20, 21])  # ... and this one pushes request 2's out
    assert p.propose(4, 2) == []
    p.extend(3, [6, 7])
    p.extend(4, [7, 8, 9])
    p.start(5, [7, 8])  # pushes request 3 out: 4 stays
    assert p.propose(5, 2) == [9]
    assert p.cached_requests == 2


def test_suffix_reused_request_id_keeps_the_finished_response():
    p = SuffixProposer()
    p.start(1, [0])
    p.extend(1, [1, 2, 3])
    p.start(1, [4, 5])  # the engine reuses slot ids: the old request is finished first
    p.extend(1, [4])
    assert p.propose(1, 2) == [5]
    p.extend(1, [1, 2])
    assert p.propose(1, 1) == [3]  # from the first request's cached response
    assert p.cached_requests == 2


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
    [("max_tree_depth", 0), ("max_cached_requests", -1),
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


def test_suffix_float32_arithmetic_matches_numpy_float32_bit_for_bit():
    # The walk computes in Python floats rounded to float32 after each operation; numpy's
    # float32 scalars (what the C++ tree's floats are) are the oracle, on the operations the
    # walk makes: count ratios, running products and running sums.
    from qpcbuild.runtime.suffix_tree import f32

    rng = np.random.default_rng(7)
    f = np.float32
    for _ in range(20000):
        parent = int(rng.integers(1, 1 << 20))
        child = int(rng.integers(1, parent + 1))
        prob = f(rng.random())
        score = f(rng.random() * 8)
        ratio = f(child) / f(parent)
        assert f32(child / parent) == float(ratio)
        assert f32(float(prob) * f32(child / parent)) == float(f(prob * ratio))
        assert f32(float(score) + float(prob)) == float(f(score + prob))


def test_suffix_tree_removal_returns_every_node_and_eviction_keeps_only_cached_responses():
    # The tree's nodes are integer ids in flat tables: what a removed sequence alone held must
    # come back, or a long-running server's tree grows with every evicted request. The oracle
    # is a tree built fresh from the sequences that remain.
    import random

    from qpcbuild.runtime.suffix_tree import SuffixTree

    rng = random.Random(5)
    seqs = {i: [rng.randrange(6) for _ in range(rng.randrange(1, 40))] for i in range(30)}
    tree = SuffixTree(8)
    for i, seq in seqs.items():
        tree.extend(i, seq)
    for i in range(0, 30, 2):
        tree.remove(i)
    fresh = SuffixTree(8)
    for i in range(1, 30, 2):
        fresh.extend(i, seqs[i])
    assert tree.node_count == fresh.node_count > 0
    for i in range(1, 30, 2):
        tree.remove(i)
    assert tree.node_count == 0

    p = SuffixProposer(max_tree_depth=8, max_cached_requests=2)
    for rid in range(12):
        p.start(rid, [99])
        p.extend(rid, seqs[rid])
        p.finish(rid)
    kept = SuffixTree(8)
    for rid in (10, 11):
        kept.extend(rid, seqs[rid])
    assert p._global.node_count == kept.node_count


def test_suffix_tree_refuses_token_ids_it_cannot_key():
    from qpcbuild.runtime.suffix_tree import SuffixTree

    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match="outside"):
            SuffixTree(4).extend(0, [1, bad])

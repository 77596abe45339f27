"""The decoding loop's bookkeeping on a toy model whose outputs are known in advance: what is
counted as accepted, what the proposer is told, and how many tokens survive top-k."""

from __future__ import annotations

import numpy as np

from qpcbuild.runtime.proposers import SuffixProposer
from qpcbuild.runtime import sampling
from qpcbuild.runtime.sampling import SamplingParams, WindowProbabilities, probabilities

from helpers_adaptive import chi_square_p
from helpers_engine import PREFILL, V, Scripted, decoder


def test_drafts_accepted_after_an_eos_are_not_counted():
    # Prefill of 1 2 gives 3; the target then continues 4, 5=EOS, 6, 7. The proposal 4 5 6 7
    # is all "right" by argmax, but 6 and 7 come after the EOS and are cut from the output.
    rows, _ = decoder(Scripted([4, 5, 6, 7])).generate([[1, 2]], 10, SamplingParams())
    st = rows[0].stats
    assert rows[0].tokens == [1, 2, 3, 4, 5] and rows[0].finish_reason == "eos"
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 4, 2)
    assert st.accepted_per_pos == [1, 1, 0, 0]


def test_a_finished_request_reaches_the_proposer_whole():
    proposer = Scripted([])
    rows, _ = decoder(proposer).generate([[10, 11]], 3, SamplingParams())
    assert rows[0].tokens == [10, 11, 12, 13, 14]
    assert proposer.seen == rows[0].tokens  # the last step's tokens were extended too


def test_suffix_cache_holds_the_final_tokens_of_earlier_requests():
    suffix = SuffixProposer(max_tree_depth=8)
    dec = decoder(suffix)
    dec.generate([[7, 8]], 3, SamplingParams())  # 7 8 -> 9 10 11
    suffix.start(99, [0, 10])  # (a context is never matched whole: 0 leads in)
    assert suffix.propose(99, 1) == [11]  # learned from the last generated token


def test_top_k_keeps_exactly_k_tokens_even_with_ties():
    logits = np.array([1.0, 3.0, 3.0, 3.0, 0.5, 3.0])
    probs = probabilities(logits, SamplingParams(1.0, top_k=2))
    assert np.count_nonzero(probs) == 2 and probs[1] == probs[2] == 0.5



def test_a_windows_rows_computed_one_at_a_time_equal_the_whole_windows():
    """Verification computes a window's probabilities row by row, as far as it reads; each row
    must be bit for bit the row of the whole window's (temperature, top-k and top-p)."""
    rng = np.random.default_rng(5)
    for sp in (SamplingParams(1.0), SamplingParams(0.7, top_k=40), SamplingParams(1.3, top_p=0.8)):
        logits = (rng.standard_normal((5, 3001)) * 4).astype(np.float32)
        whole, rows = probabilities(logits, sp), WindowProbabilities(logits, sp)
        for i in (3, 0, 4, 1, 2, 3):
            assert np.array_equal(rows[i], whole[i]) and rows[i, 17] == whole[i, 17]


def _block_then_uniform(probs, rng):
    """Broken: the block by its mass, then any of its nonzero entries alike."""
    b = sampling._BLOCK
    sums = np.add.reduceat(probs.astype(np.float64), np.arange(0, len(probs), b))
    start = b * int(rng.choice(len(sums), p=sums / sums.sum()))
    return start + int(rng.choice(np.flatnonzero(probs[start:start + b])))


def test_sample_draws_each_entry_in_proportion_and_never_a_zero():
    """`sample`'s two-level CDF against the distribution's definition, probs / sum(probs), on
    float32 rows that are not a whole number of blocks, with a block of zeros, zeros between
    entries and tiny entries beside large ones; a broken second level must be rejected."""
    rng = np.random.default_rng(11)
    b = sampling._BLOCK
    probs = np.zeros(5 * b + 23, np.float32)
    live = rng.choice(np.r_[0:b, 2 * b:len(probs)], 60, replace=False)  # block 1 stays empty
    probs[live] = rng.random(60) * 3
    probs[live[:5]] = 1e-7
    want = probs.astype(np.float64) / probs.sum(dtype=np.float64)
    for draw, ok in ((sampling.sample, True), (_block_then_uniform, False)):
        counts = np.bincount([draw(probs, rng) for _ in range(60_000)], minlength=len(probs))
        assert counts[probs == 0].sum() == 0
        assert (chi_square_p(counts, want) > 1e-3) == ok, draw.__name__

    class Edge:  # uniform draws at the ends of [0, 1)
        def __init__(self, u):
            self.u = u

        def random(self):
            return self.u

    assert sampling.sample(probs, Edge(0.0)) == np.flatnonzero(probs)[0]
    assert sampling.sample(probs, Edge(np.nextafter(1.0, 0.0))) == np.flatnonzero(probs)[-1]


def test_a_proposal_verifies_in_the_smallest_compiled_window_that_holds_it():
    class Lengths(Scripted):  # the target's own next tokens, 1 then 2 then 3, then none
        def propose(self, rid, k):
            n = self.lengths.pop(0) if self.lengths else 0
            return [(self.seen[-1] + 1 + i) % V for i in range(n)]

    for ks, want in (((0, 1, 2, 4), [PREFILL, 2, 3, 5, 1, 1]), ((0, 4), [PREFILL, 5, 5, 5, 1, 1])):
        proposer = Lengths([])
        proposer.lengths = [1, 2, 3]
        dec = decoder(proposer, ks=ks)
        rows, _ = dec.generate([[6, 7]], 12, SamplingParams())
        assert rows[0].tokens == [(6 + i) % V for i in range(14)]
        assert dec.target.widths == want, ks

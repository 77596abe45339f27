"""Shadow proposals (gate.py): while speculation is off, a model-free proposer's proposals are
matched against the tokens the plain steps produce, so the gate learns its acceptance without
speculating. Checked here: speculation comes back as soon as the proposals turn good (and not
by probing while they are bad), the proposals stay within their time budget, and under sampling
the settled lengths follow the law of speculative verification computed outside the code,
which a shadow matched one token late does not."""

from __future__ import annotations

import numpy as np

from qpcbuild.runtime.engine import SpecDecoder
from qpcbuild.runtime.gate import Goodput
from qpcbuild.runtime.sampling import SamplingParams

from helpers_adaptive import (PREFILL, V, Counting, Markov, chi_square_p, counting_prompt, decoder,
                              markov_pair)

# a plain step 2 ms, a K=4 step 4 ms: right proposals (5 tokens a step) pay, wrong ones do not
CHEAP_WINDOWS = dict(cost=lambda width: 0.002 + 0.0005 * (width - 1))
PROMPT = counting_prompt(3)  # 5 tokens; the prefill adds the first new one


class Phased:
    """Proposes a wrong token until the context holds `turn` tokens, then what the counting
    target will produce. `delay`: seconds each proposal takes."""

    name = "phased"

    def __init__(self, turn: int, delay: float = 0.0):
        self.turn, self.delay, self.seq, self.calls = turn, delay, {}, 0
        self.clock = None  # the decoder's (logged_run sets it): a proposal takes `delay` of it

    def start(self, rid, tokens):
        self.seq[rid] = list(tokens)

    def extend(self, rid, tokens):
        self.seq[rid] += list(tokens)

    def propose(self, rid, k):
        self.calls += 1
        if self.delay:
            self.clock.advance(self.delay)
        seq = self.seq[rid]
        if len(seq) < self.turn:
            return [(seq[-1] + 5) % V] * k
        return [(seq[-1] + j + 1) % V for j in range(k)]

    def finish(self, rid):
        pass


def logged_run(proposer, shadowed: bool, new_tokens: int = 200):
    """Tokens and the mode of every step of one auto-gated run."""
    target = Counting(**CHEAP_WINDOWS)
    proposer.clock = target.clock
    dec = decoder(target, proposer=proposer, policy="auto")
    gate = dec.gate()
    gate.shadowed = shadowed
    modes, record = [], gate.record
    gate.record = lambda mode, seconds, rows: (modes.append(mode), record(mode, seconds, rows))
    rows, times = dec.generate([PROMPT], new_tokens, SamplingParams())
    return rows[0], times, modes


def test_speculation_resumes_when_the_proposals_turn_good_without_probing_before():
    turn = 80
    steps_before_turn = turn - len(PROMPT) - 1  # every step before it makes one token
    row, times, modes = logged_run(Phased(turn), shadowed=True)
    assert row.tokens == counting_prompt(3, len(PROMPT) + 200)
    assert times.speculation.shadow_checks > 20
    # the only speculative steps while proposals were wrong: the first few, before any plain
    assert modes[:steps_before_turn].count("spec") <= 6
    resumed = modes.index("spec", steps_before_turn)
    # two or three shadows of 4 right tokens (one lucky shadow is not evidence), then the switch
    assert resumed <= steps_before_turn + 14
    assert modes[resumed:].count("plain") <= 4

    # without shadows the gate finds out only by probing: speculative steps spent on wrong
    # proposals. (When it resumes depends on where a probe lands: a probe can fall on the turn
    # itself, so that is not compared.)
    row_p, _, probed = logged_run(Phased(turn), shadowed=False)
    assert row_p.tokens == row.tokens
    assert probed[:steps_before_turn].count("spec") > modes[:steps_before_turn].count("spec")


def test_shadow_proposals_keep_to_their_time_budget():
    # a 1 ms proposal against 2 ms plain steps: at 2% of the plain time, one every ~25 steps
    proposer = Phased(turn=10 ** 6, delay=0.001)
    _, times, modes = logged_run(proposer, shadowed=True)
    plain, spec = modes.count("plain"), modes.count("spec")
    shadows = proposer.calls - spec
    assert plain > 150 and 2 <= shadows <= plain / 10
    assert times.speculation.shadow_checks >= shadows - 1  # each settled (the last may be open)


class Chain:
    """Proposes the next three states a -> a+1 -> a+2 -> a+3 (mod n) of a Markov chain."""

    name = "chain"

    def __init__(self, n: int):
        self.n, self.last = n, {}

    def start(self, rid, tokens):
        self.last[rid] = tokens[-1]

    def extend(self, rid, tokens):
        if tokens:
            self.last[rid] = tokens[-1]

    def propose(self, rid, k):
        return [(self.last[rid] + j + 1) % self.n for j in range(k)]

    def finish(self, rid):
        pass


def settled_counts(monkeypatch, late: bool = False, calls: int = 25, batch: int = 64):
    """counts[a, t]: shadows proposed after state a that settled at t + 1 tokens (t drafts
    matched), decoding a Markov target at temperature 1 with speculation held off. `late`:
    a broken gate that matches each shadow against the plain steps one token late."""
    p, _ = markov_pair()
    n = p.shape[0]
    monkeypatch.setattr(Goodput, "choose", lambda self, rates: "plain")
    monkeypatch.setattr(Goodput, "_shadow_gap", lambda self, live_rows: 0)
    learned, settled = [], []
    monkeypatch.setattr(Goodput, "_learn",
                        lambda self, rate, tokens, *weight: learned.append(tokens))
    observe = Goodput.observe_plain

    def watched(self, rate, token, live_rows):
        shadow = rate.shadow
        if late and shadow is not None and not getattr(rate, "skipped", False):
            rate.skipped = True  # the broken variant: the first token after a proposal unseen
            return
        observe(self, rate, token, live_rows)
        if shadow is not None and rate.shadow is None:
            rate.skipped = False
            if len(shadow) == 3:  # proposals cut short by the row's end are left out
                settled.append(((shadow[0] - 1) % n, learned[-1]))

    monkeypatch.setattr(Goodput, "observe_plain", watched)
    dec = SpecDecoder(Markov("target", p, batch), None, Chain(n), (0, 3), PREFILL, {999},
                      "ngram", policy="auto")
    for seed in range(calls):
        dec.generate([[0]] * batch, 30, SamplingParams(1.0, seed=seed))
    counts = np.zeros((n, 4))
    for a, tokens in settled:
        counts[a, tokens - 1] += 1
    return counts, p


def verification_law(p: np.ndarray) -> np.ndarray:
    """law[a, t]: speculative sampling of the point-mass proposal a+1, a+2, a+3 after state a
    accepts exactly t of them: each is accepted with the target's probability of it."""
    n = p.shape[0]
    law = np.zeros((n, 4))
    for a in range(n):
        chain = [a, (a + 1) % n, (a + 2) % n, (a + 3) % n]
        reach = 1.0
        for t in range(3):
            accept = p[chain[t], chain[t + 1]]
            law[a, t] = reach * (1 - accept)
            reach *= accept
        law[a, 3] = reach
    return law


def expected(counts: np.ndarray, law: np.ndarray) -> np.ndarray:
    totals = counts.sum(axis=1, keepdims=True)
    return totals * law / totals.sum()


def test_sampled_shadows_settle_as_verification_would_accept(monkeypatch):
    counts, p = settled_counts(monkeypatch)
    assert counts.sum() > 10_000 and (counts[:, 1:].sum() > 2_000)
    assert chi_square_p(counts, expected(counts, verification_law(p))) > 1e-3


def test_the_law_test_rejects_shadows_matched_one_token_late(monkeypatch):
    counts, p = settled_counts(monkeypatch, late=True)
    assert chi_square_p(counts, expected(counts, verification_law(p))) < 1e-3

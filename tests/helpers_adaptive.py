"""Toy models for the adaptive-speculation tests (test_adaptive.py, test_shadow_proposals.py):
targets, drafts and proposers whose outputs, costs and laws are known exactly."""

from __future__ import annotations

import numpy as np

from qpcbuild.runtime.engine import SpecDecoder

V, EOS, PREFILL = 64, 999, 8  # EOS: never produced


class Clock:
    """The decoder's clock in these tests: seconds pass only when a toy model or proposer says
    a call took them, so the step times the gate decides with are exact and no test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Counting:
    """A target whose greedy next token is (token + 1) % V; a call takes `cost(window)`
    seconds of its clock, so speculation's price is known. A prefill chunk returns its last
    real position's logits, as the exported graph does."""

    role, ctx_len, vocab_size, specializations = "target", 256, V, []

    def __init__(self, batch=1, cost=lambda width: 0.0):
        self.batch_size, self.cost, self.widths = batch, cost, []
        self.clock = Clock()

    def run(self, input_ids, position_ids, batch_index=None):
        width = input_ids.shape[1]
        self.widths.append(width)
        if width != PREFILL:
            self.clock.advance(self.cost(width))
        logits = np.zeros((*input_ids.shape, V), np.float32)
        for b, s in np.ndindex(input_ids.shape):
            logits[b, s, (input_ids[b, s] + 1) % V] = 10.0
        if width == PREFILL:
            last = np.maximum((position_ids >= 0).sum(axis=1) - 1, 0)
            return logits[np.arange(len(last)), last][:, None]
        return logits


class KVDraft:
    """A draft that proposes the target's token only from a correct cache: it keeps the token
    written at each position and predicts token + 1 only when every earlier position holds
    the count that leads to it (as it does when every earlier token was fed in order). `confidence(token)` is
    the probability of its top token."""

    role, ctx_len, vocab_size, specializations = "draft", 256, V, []

    def __init__(self, batch=1, confidence=lambda token: 0.99):
        self.batch_size, self.confidence = batch, confidence
        self.kv = [dict() for _ in range(batch)]
        self.calls = 0

    def run(self, input_ids, position_ids, batch_index=None):
        self.calls += 1
        logits = np.zeros((*input_ids.shape, V), np.float32)
        for b, s in np.ndindex(input_ids.shape):
            p = int(position_ids[b, s])
            if p < 0:
                continue
            row = int(batch_index[b, 0]) if batch_index is not None else b
            tok = int(input_ids[b, s])
            self.kv[row][p] = tok
            # the whole history in place (the prompts here count up too)
            good = all(self.kv[row].get(i) == (tok - p + i) % V for i in range(p))
            guess = (tok + 1) % V if good else (tok + 7) % V
            c = self.confidence(tok)  # softmax top probability c over V tokens
            logits[b, s, :] = 0.0
            logits[b, s, guess] = np.log(c * (V - 1) / (1 - c))
        if input_ids.shape[1] == PREFILL:
            last = np.maximum((position_ids >= 0).sum(axis=1) - 1, 0)
            return logits[np.arange(len(last)), last][:, None]
        return logits


def counting_prompt(start: int, n: int = 5) -> list[int]:
    return [(start + i) % V for i in range(n)]


def decoder(target, draft=None, proposer=None, ks=(0, 4), **kw):
    """A decoder on the target's clock, where it keeps one (Counting)."""
    if hasattr(target, "clock"):
        kw.setdefault("clock", target.clock)
    return SpecDecoder(target, draft, proposer, ks, PREFILL, {EOS},
                       "draft_model" if draft else "ngram", **kw)


class Wrong:
    """A proposer whose proposals are always rejected."""

    name = "wrong"

    def __init__(self):
        self.calls = 0

    def start(self, rid, tokens):
        self.last = tokens[-1]

    def extend(self, rid, tokens):
        self.last = tokens[-1] if tokens else self.last

    def propose(self, rid, k):
        self.calls += 1
        return [(self.last + 5) % V] * k

    def finish(self, rid):
        pass



class Markov:
    """A model whose next-token distribution depends on the last token only: logits log T[a].
    The joint law of the tokens it generates is then known exactly."""

    ctx_len, specializations = 64, []

    def __init__(self, role, table, batch):
        self.role, self.table, self.batch_size = role, np.log(table), batch
        self.vocab_size = table.shape[0]

    def run(self, input_ids, position_ids, batch_index=None):
        logits = self.table[input_ids].astype(np.float32)
        if input_ids.shape[1] == PREFILL:
            last = np.maximum((position_ids >= 0).sum(axis=1) - 1, 0)
            return logits[np.arange(len(last)), last][:, None]
        return logits


def markov_pair(seed=0, n=5):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(n), size=n)
    # the draft: confident (one token at 0.8) after even tokens, flat after odd ones, and
    # different from the target everywhere
    q = rng.dirichlet(np.ones(n) * 0.5, size=n)
    for a in range(0, n, 2):
        q[a] = 0.2 / (n - 1)
        q[a, (a + 1) % n] = 0.8
    return p, q



def chi_square_p(counts, probs):
    from scipy import stats as scipy_stats

    counts, probs = counts.ravel(), probs.ravel()
    big = probs * counts.sum() >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big], probs[~big].sum()) * counts.sum()
    keep = exp > 0
    return scipy_stats.chisquare(obs[keep], exp[keep]).pvalue

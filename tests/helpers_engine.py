"""A toy decoding setup whose outputs are known in advance, shared by the engine's bookkeeping
tests (test_engine_rules.py) and the replay oracle (test_bench_tune.py): a target whose greedy
next token is token + 1, a proposer that always offers the same continuation, and the
SpecDecoder that joins them."""

from __future__ import annotations

import numpy as np

from qpcbuild.runtime.engine import SpecDecoder

V, EOS = 16, 5


PREFILL = 8


class CountingModel:
    """A target whose greedy next token is always (token + 1) % V. Like the exported graph,
    a prefill chunk returns the logits of its last real position only."""

    role, batch_size, ctx_len, vocab_size, specializations = "target", 1, 64, V, []

    def __init__(self):
        self.widths: list[int] = []  # seq_len of every call, prefill chunks included

    def run(self, input_ids, position_ids, batch_index=None):
        self.widths.append(input_ids.shape[1])
        logits = np.zeros((*input_ids.shape, V), np.float32)
        for b, s in np.ndindex(input_ids.shape):
            logits[b, s, (input_ids[b, s] + 1) % V] = 10.0
        if input_ids.shape[1] == PREFILL:
            last = (position_ids >= 0).sum(axis=1) - 1
            return logits[np.arange(len(last)), last][:, None]
        return logits


class Scripted:
    """A proposer that always offers the same continuation, recording what it is told."""

    name = "scripted"

    def __init__(self, proposal):
        self.proposal, self.seen = proposal, []

    def start(self, rid, tokens):
        self.seen = list(tokens)

    def extend(self, rid, tokens):
        self.seen += list(tokens)

    def propose(self, rid, k):
        return self.proposal[:k]

    def finish(self, rid):
        pass


def decoder(proposer, ks=(0, 4)):
    return SpecDecoder(CountingModel(), None, proposer, ks, PREFILL, {EOS}, "ngram")

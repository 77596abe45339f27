"""The C suffix tree (qpcbuild/runtime/_suffix_tree.c) against the Python one, its oracle.

The C tree must be the Python tree bit for bit: the same drafts (tokens, float32 probabilities
and scores, match lengths), node counts, suffix nodes, and even the same node tables (ids, free
list, sibling links), since ids and sibling order decide ties. Small vocabularies make ties and
sibling moves common. The tests skip when the extension is not built, except in CI (`CI` set),
which builds it and fails here when it did not.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import tracemalloc

import pytest

from qpcbuild.runtime import suffix_tree
from qpcbuild.runtime.proposers import SuffixProposer
from qpcbuild.runtime.suffix_tree import Draft, PythonSuffixTree

FACTORS = (0.0, 0.25, 1 / 3, 0.5, 1.0, 1.5, 2.7, 4.0)
OFFSETS = (0.0, 0.5, 1.0, 2.25, -1.0, -0.3)
MIN_PROBS = (0.0, 0.05, 0.1, 1 / 3, 0.5, 0.9, 1.0)
SPEC_TOKENS = (-1, 0, 1, 2, 3, 4, 8, 100)


@pytest.fixture(scope="module")
def native():
    if suffix_tree.NativeSuffixTree is None:
        try:
            import qpcbuild.runtime._suffix_tree  # noqa: F401  (for its error)
            why = "it imports, yet suffix_tree.py did not load it"
        except ImportError as exc:
            why = str(exc)
        reason = f"the C suffix tree is not built ({why}); `pip install -e .` builds it"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}, and CI must test it")
        pytest.skip(reason)
    return suffix_tree.NativeSuffixTree


def assert_same_tables(py: PythonSuffixTree, c) -> None:
    tables = c._tables()
    assert tables == {"count": py._count, "token": py._token, "first": py._first,
                      "last": py._last, "next": py._next, "prev": py._prev, "free": py._free}


def assert_same_state(py: PythonSuffixTree, c, seq_ids) -> None:
    assert c.node_count == py.node_count
    for sid in seq_ids:
        assert c.has(sid) == py.has(sid) == (sid in c) == (sid in py)
        assert list(c.suffix_nodes(sid)) == list(py.suffix_nodes(sid))


def assert_same_draft(want: Draft, got: Draft) -> None:
    assert type(got) is Draft
    assert got.token_ids == want.token_ids
    # float.hex: equal bits, not just equal values
    assert [p.hex() for p in got.probs] == [p.hex() for p in want.probs]
    assert got.score.hex() == want.score.hex()
    assert got.match_len == want.match_len


def random_context(rng: random.Random, py: PythonSuffixTree, vocab: int, depth: int,
                   seq_ids) -> tuple[list[int], int | None]:
    """A context and the id of a sequence it ends with (None: it ends with none)."""
    live = [sid for sid in seq_ids if py.has(sid)]
    n = rng.randrange(0, depth + 4)
    if live and rng.random() < 0.7:
        sid = rng.choice(live)
        tail = py._seqs[sid][-n:] if n else []
        if rng.random() < 0.3:  # longer than the sequence: a prefix it does not have
            tail = [rng.randrange(vocab) for _ in range(rng.randrange(3))] + tail
        return tail, (sid if tail == py._seqs[sid][len(py._seqs[sid]) - len(tail):] else None)
    context = [rng.randrange(vocab) for _ in range(n)]
    if context and rng.random() < 0.1:  # a token outside 0 .. 2**32 - 1 (a caller's bug)
        i = rng.randrange(len(context))
        context[i] = rng.choice((-1, -(2**33), 2**70, -(2**70))) + context[i] \
            if rng.random() < 0.5 else context[i] + 2**32 * rng.choice((-2, -1, 1, 2))
    return context, None


def compare_speculation(rng: random.Random, py: PythonSuffixTree, c, vocab: int, depth: int,
                        seq_ids) -> bool:
    """One random proposal from both trees, with each way of giving the shortcut; whether it
    proposed anything."""
    context, sid = random_context(rng, py, vocab, depth, seq_ids)
    args = (rng.choice(SPEC_TOKENS), rng.choice(FACTORS), rng.choice(OFFSETS),
            rng.choice(MIN_PROBS))
    want = py.speculate(context, *args)
    assert_same_draft(want, c.speculate(context, *args))
    if sid is not None:  # the shortcut changes nothing but the cost
        assert_same_draft(want, py.speculate(context, *args, known=py.suffix_nodes(sid)))
        assert_same_draft(want, c.speculate(context, *args, known=c.suffix_nodes(sid)))
        assert_same_draft(want, c.speculate(context, *args, known_seq=sid))
    other = rng.choice(seq_ids)  # a shortcut that does not fit the context: still the same
    assert_same_draft(py.speculate(context, *args, known_seq=other),
                      c.speculate(context, *args, known_seq=other))
    return bool(want.token_ids)


@pytest.mark.parametrize("seed", range(16))
def test_random_operations_agree_with_the_python_tree(native, seed):
    rng = random.Random(seed)
    vocab = rng.randint(3, 8)
    depth = (0, 1, 2, 3, 4, 5, 7, 8, 12, 24)[seed % 10]
    py, c = PythonSuffixTree(depth), native(depth)
    seq_ids = list(range(6))
    proposed = 0
    for step in range(500):
        op = rng.random()
        if op < 0.45:
            sid = rng.choice(seq_ids)
            tokens = [rng.randrange(vocab) for _ in range(rng.choice((1, 1, 2, 5, 25)))]
            py.extend(sid, tokens)
            c.extend(sid, tokens)
        elif op < 0.55:
            sid = rng.choice(seq_ids)
            if py.has(sid):
                py.remove(sid)
                c.remove(sid)
            else:
                with pytest.raises(KeyError):
                    c.remove(sid)
        else:
            proposed += compare_speculation(rng, py, c, vocab, depth, seq_ids)
        assert_same_state(py, c, seq_ids)
        if step % 25 == 0:
            assert_same_tables(py, c)
    assert_same_tables(py, c)
    if depth > 1:
        assert proposed > 20  # the comparisons were not all of empty drafts


def test_removing_everything_frees_every_node_and_ids_are_reused_alike(native):
    rng = random.Random(3)
    py, c = PythonSuffixTree(6), native(6)
    for rounds in range(5):
        for sid in range(8):
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
            py.extend(sid, tokens)
            c.extend(sid, tokens)
        for sid in rng.sample(range(8), 8):
            py.remove(sid)
            c.remove(sid)
            assert_same_tables(py, c)
        assert c.node_count == py.node_count == 0


def proposer_run(tree_class, seed: int) -> list:
    """A random request stream through a SuffixProposer on `tree_class`: every proposal, and the
    global tree's size and cached requests after each step."""
    rng = random.Random(seed)
    proposer = type("Proposer", (SuffixProposer,), {"tree_class": tree_class})(
        max_tree_depth=rng.choice((2, 4, 8, 24)), max_cached_requests=rng.choice((0, 1, 2, 3)),
        max_spec_factor=rng.choice((0.5, 1.0, 2.0)), min_token_prob=rng.choice(MIN_PROBS))
    vocab = rng.choice((3, 5, 8, 50))
    live: set[int] = set()
    out = []
    for _ in range(600):
        rid, op = rng.randrange(5), rng.random()
        if rid not in live or op < 0.05:
            proposer.start(rid, [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))])
            live.add(rid)
        elif op < 0.12:
            proposer.finish(rid)
            live.discard(rid)
        elif op < 0.6:
            proposer.extend(rid, [rng.randrange(vocab) for _ in range(rng.randint(1, 3))])
        else:
            out.append(proposer.propose(rid, rng.randrange(0, 7)))
        out.append((proposer._global.node_count, proposer.cached_requests))
    return out


def test_the_suffix_proposer_proposes_the_same_on_either_tree(native):
    drafts = 0
    for seed in range(16):
        want = proposer_run(PythonSuffixTree, seed)
        assert proposer_run(native, seed) == want, f"seed {seed}"
        drafts += sum(1 for x in want if isinstance(x, list) and x)
    assert drafts > 500  # most streams propose something


def test_bad_tokens_raise_the_same_error_after_the_same_partial_extend(native):
    for bad in (-1, 2**32, 10**30, -(10**30), "x"):
        py, c = PythonSuffixTree(4), native(4)
        py.extend(0, [1, 2])
        c.extend(0, [1, 2])
        errors = []
        for tree in (py, c):
            with pytest.raises(ValueError) as caught:
                tree.extend(0, [1, "3", 2.0, True, bad, 3])  # int() of each, as Python's int
            errors.append(str(caught.value))
        assert errors[0] == errors[1]
        if bad != "x":
            assert errors[0] == f"token id {bad} is outside 0 .. 2**32 - 1"
        assert_same_state(py, c, [0])
        assert_same_tables(py, c)


def test_unknown_and_unhashable_sequences_raise_as_a_dict_does(native):
    py, c = PythonSuffixTree(4), native(4)
    py.extend(1, [1, 2])
    c.extend(1, [1, 2])
    for tree in (py, c):
        with pytest.raises(KeyError) as caught:
            tree.remove(5)
        assert caught.value.args == (5,)
        with pytest.raises(TypeError):
            tree.remove([1])
        with pytest.raises(TypeError):
            tree.extend([1], [1])
        assert tree.suffix_nodes(7) == () or list(tree.suffix_nodes(7)) == []
    assert_same_state(py, c, [1, 5])


def test_a_context_token_outside_the_range_is_looked_up_as_the_python_looks_it_up(native):
    """The Python's edge key is parent * 2**32 + token, so a context token of 2**32 + 5 at the
    root reads node 1's edge for 5 (a caller's bug: the tree never holds such a token). The C
    tree computes the same key, so even then the two propose alike."""
    py, c = PythonSuffixTree(4), native(4)
    for tree in (py, c):
        tree.extend(0, [4, 5, 6])
    for context in ([9, 2**32 + 5], [9, 5 - 2**32], [9, 2**80], [9, -(2**80)]):
        assert_same_draft(py.speculate(context, 4, 1.0, 1.0, 0.0),
                          c.speculate(context, 4, 1.0, 1.0, 0.0))
    assert c.speculate([9, 2**32 + 5], 4, 1.0, 1.0, 0.0).token_ids == [6]


@pytest.mark.parametrize("factor, offset, error", [
    (1e39, 0.0, OverflowError),  # f32 (struct's native "f") makes it inf; int(inf) refuses
    (3e38, 0.0, OverflowError),  # match_len x factor overflows float32
    (1.0, 1e39, OverflowError),
    (float("inf"), 0.0, OverflowError),
    (float("nan"), 0.0, ValueError),  # int(nan)
    (float("inf"), float("-inf"), ValueError),
])
def test_out_of_range_parameters_raise_the_same_error(native, factor, offset, error):
    py, c = PythonSuffixTree(4), native(4)
    messages = []
    for tree in (py, c):
        tree.extend(0, [1, 2, 1, 2, 1])
        with pytest.raises(error) as caught:
            tree.speculate([1, 2, 1], 4, factor, offset, 0.1)
        messages.append(str(caught.value))
        # read at the first match only: without one, nothing to refuse
        assert tree.speculate([7, 7], 4, factor, offset, 0.1) == Draft()
        assert tree.speculate([1], 4, factor, offset, 0.1) == Draft()
    assert messages[0] == messages[1]


@pytest.mark.parametrize("min_prob", (1e39, float("inf"), float("nan"), -1.0, 1.5))
def test_out_of_range_probabilities_propose_the_same(native, min_prob):
    py, c = PythonSuffixTree(4), native(4)
    for tree in (py, c):
        tree.extend(0, [1, 2, 1, 2, 1, 3, 1, 2])
    for context in ([1, 2, 1], [2, 1], [3, 1, 2]):
        assert_same_draft(py.speculate(context, 4, 1.5, 1.0, min_prob),
                          c.speculate(context, 4, 1.5, 1.0, min_prob))


def test_the_environment_variable_selects_the_python_tree(native):
    probe = "from qpcbuild.runtime import suffix_tree as s; print(s.IMPLEMENTATION)"
    for value, want in (("1", "python"), ("0", "c"), (None, "c")):
        env = {k: v for k, v in os.environ.items() if k != "QPCBUILD_PURE_PYTHON_SUFFIX"}
        if value is not None:
            env["QPCBUILD_PURE_PYTHON_SUFFIX"] = value
        run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        assert run.stdout.strip() == want


def test_no_memory_is_kept_after_trees_are_dropped(native):
    """Every allocation of the C tree goes through PyMem, which tracemalloc sees: trees built,
    used, failing and dropped (one in a reference cycle through its seq ids) leave nothing."""
    rng = random.Random(11)

    def churn():
        tree = native(8)
        for sid in range(6):
            tree.extend(sid, [rng.randrange(5) for _ in range(200)])
        tree.speculate([1, 2, 3, 4], 4, 1.0, 0.0, 0.1, known_seq=2)
        tree.speculate([1, 2, 3, 4], 4, 1.0, 0.0, 0.1, known=tree.suffix_nodes(1))
        for sid in range(0, 6, 2):
            tree.remove(sid)
        with pytest.raises(ValueError):
            tree.extend(1, [1, -1])
        with pytest.raises(KeyError):
            tree.remove(0)
        tree.extend((tree,), [1, 2, 3])  # a cycle only the collector frees

    churn()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            churn()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 64 * 1024  # a tree of this size holds ~200 KiB

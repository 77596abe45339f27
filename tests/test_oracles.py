"""Independent oracles for the runtime's claims.

- Greedy output of every method (draft_model, ngram, suffix, turbo), both ONNX Runtime lowerings,
  batch 1 and batch > 1, continuous batching, a draft with a vocabulary subset (which cannot
  propose a third of the tokens) and prompts longer than one prefill chunk equals
  transformers' own `generate` on the source checkpoint, token for token. Our own target-only
  loop is not the reference: a bug shared by both would pass that comparison.
- The acceptance rule of speculative sampling produces exactly the target distribution, checked
  by chi-square tests with well-populated cells against distributions computed outside our code
  (synthetic p and q; transformers' logits and its own temperature / top-k / top-p warpers), and
  each test rejects deliberately broken rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats
from typer.testing import CliRunner

import qpcbuild
from qpcbuild.cli import app
from qpcbuild.runtime import eagle3, engine, heads, sampling
from qpcbuild.runtime.sampling import SamplingParams, accept_sampling
from qpcbuild.testing import write_random_turbo_heads, write_shortcut_eagle3_head

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo"
runner = CliRunner()


@pytest.fixture(scope="module")
def hf_target():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Held-out prompts of the demo pair, one of them longer than two prefill chunks (32)."""
    lines = [json.loads(line)["text"] for line in
             (DEMO / "eval_prompts.jsonl").read_text().splitlines() if line.strip()]
    long = "\n".join(lines[:4])
    return [lines[5], long, lines[6], lines[7]]


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def hf_reference(model, ids: list[int], max_new_tokens: int = 40) -> list[int]:
    """transformers' greedy `generate` (computed once per prompt for all cases)."""
    import torch

    if tuple(ids) not in _REFERENCE:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, num_beams=1)
        _REFERENCE[tuple(ids)] = out[0, len(ids):].tolist()
    return _REFERENCE[tuple(ids)]


def demo_subset(tmp_path_factory) -> str:
    """A vocabulary subset for the demo draft without every third token id (EOS kept)."""
    path = tmp_path_factory.getbasetemp() / "demo-subset.json"
    vocab = json.loads((DEMO / "draft" / "config.json").read_text())["vocab_size"]
    path.write_text(json.dumps({"token_ids": [t for t in range(vocab) if t % 3 != 1]}))
    return f"draft.vocab_subset={path}"


def demo_heads(tmp_path_factory, scale: float) -> tuple[str, ...]:
    """The demo recipe turned into a turbo one, with three heads for the demo target: random
    (scale 1: their proposals are rarely right, and are verified all the same) or untrained
    (scale 0: zero weights, as QEfficient initialises a head, so each head's distribution is
    the base model's at the same position: near the target's next-token distribution, and
    not equal to it)."""
    path = tmp_path_factory.getbasetemp() / f"demo-heads-{scale:g}"
    if not path.is_dir():
        write_random_turbo_heads(path, 256, heads=3, layers=2, seed=1, scale=scale)
    return ("draft.method=turbo", f"draft.model={path}", "speculation.num_speculative_tokens=[0,3]")


def build(tmp_path_factory, recipe: str, *overrides: str) -> Path:
    root = tmp_path_factory.mktemp("oracle")
    overrides = tuple(demo_subset(tmp_path_factory) if o == SUBSET else o for o in overrides)
    overrides = tuple(x for o in overrides
                      for x in (demo_heads(tmp_path_factory, TURBO_SCALES[o])
                                if o in TURBO_SCALES else (o,)))
    argv = ["compile", str(REPO / "recipes" / recipe), "-o", str(root / "b"), "--cache-dir",
            str(root.parent / "oracle-cache")]
    for o in overrides:
        argv += ["--set", o]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    return root / "b"


SUBSET = "<demo subset>"
TURBO, UNTRAINED_TURBO = "<demo turbo heads>", "<demo untrained turbo heads>"
TURBO_SCALES = {TURBO: 1.0, UNTRAINED_TURBO: 0.0}
CASES = {
    "draft_model-fused": ("demo.yaml", ()),
    "draft_model-vocab-subset": ("demo.yaml", (SUBSET,)),
    "draft_model-portable": ("demo.yaml", ("onnxruntime.graph=portable",)),
    "draft_model-batch2": ("demo.yaml", ("shapes.batch_size=2",)),
    "draft_model-continuous-batching": ("demo.yaml", ("shapes.full_batch_size=3",)),
    # goodput-gated, confidence-stopped drafts in the smallest window that holds them
    "draft_model-auto-p-min": ("demo.yaml", ("speculation.policy=auto",
                                             "speculation.draft_p_min=0.6",
                                             "speculation.num_speculative_tokens=[1,2,4]")),
    "draft_model-cb-auto": ("demo.yaml", ("shapes.full_batch_size=3", "speculation.policy=auto")),
    "ngram-fused": ("demo-ngram.yaml", ()),
    "ngram-batch2": ("demo-ngram.yaml", ("shapes.batch_size=2",)),
    "suffix-fused": ("demo-suffix.yaml", ()),
    "suffix-portable": ("demo-suffix.yaml", ("onnxruntime.graph=portable",)),
    "suffix-continuous-batching": ("demo-suffix.yaml", ("shapes.full_batch_size=2",)),
    "turbo-fused": ("demo.yaml", (TURBO,)),
    "turbo-portable": ("demo.yaml", (TURBO, "onnxruntime.graph=portable")),
    "turbo-batch2": ("demo.yaml", (TURBO, "shapes.batch_size=2")),
    "turbo-continuous-batching": ("demo.yaml", (TURBO, "shapes.full_batch_size=3")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_transformers_generate(case, tmp_path_factory, hf_target, prompts):
    recipe, overrides = CASES[case]
    gen = qpcbuild.load(build(tmp_path_factory, recipe, *overrides))
    ids = [gen.encode(p) for p in prompts]
    assert max(map(len, ids)) > 2 * gen.manifest.shapes.prefill_seq_len
    per_call = len(ids) if gen.decoder.cb else gen.target.batch_size
    got: list[list[int]] = []
    drafts = []
    for start in range(0, len(ids), per_call):
        result = gen.generate(ids[start:start + per_call], max_new_tokens=40)
        got += [r.tokens[len(r.prompt):] for r in result.rows]
        drafts.append(result.stats.num_drafts)
    # speculation really ran (a gated run may have turned it off for later calls)
    assert all(drafts) if gen.decoder.policy == "fixed" else sum(drafts) > 0
    for n, prompt_ids in enumerate(ids):
        assert got[n] == hf_reference(hf_target, prompt_ids), f"prompt {n}"


# ---------------------------------------------------------------- the acceptance rule
def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * counts.sum()
    assert expected.min() >= 5, "every cell must be well populated for the test to have power"
    return float(scipy_stats.chisquare(counts, expected).pvalue)


def resample_from_p(p, q, drafts, rng):
    """Broken: on rejection, sample from p instead of the residual max(0, p - q)."""
    for i, x in enumerate(drafts):
        if rng.random() < min(1.0, p[i, x] / q[i, x]):
            continue
        return i, sampling.sample(p[i], rng)
    return len(drafts), sampling.sample(p[len(drafts)], rng)


def ignore_q(p, q, drafts, rng):
    """Broken: accept with probability p(x), as if the proposal were uniform."""
    for i, x in enumerate(drafts):
        if rng.random() < p[i, x]:
            continue
        return i, sampling.sample(np.maximum(p[i] - q[i], 0) / np.maximum(p[i] - q[i], 0).sum(),
                                  rng)
    return len(drafts), sampling.sample(p[len(drafts)], rng)


def skip_bonus(p, q, drafts, rng):
    """Broken: after every draft is accepted, repeat the last draft instead of sampling p."""
    n, token = accept_sampling(p, q, drafts, rng)
    return (n, drafts[-1]) if drafts and n == len(drafts) else (n, token)


def _generate(rule, p, q, rng, n_tokens: int, k: int = 2) -> list[int]:
    """Speculative steps over a position-indexed toy model (the target's distribution at
    generated position j is p[j], the draft's q[j], whatever came before) until n_tokens."""
    out: list[int] = []
    while len(out) < n_tokens:
        j = len(out)
        kk = min(k, len(q) - j)
        drafts = [sampling.sample(q[j + i], rng) for i in range(kk)]
        n, nxt = rule(p[j:j + kk + 1], q[j:j + kk], drafts, rng)
        out += drafts[:n] + [nxt]
    return out[:n_tokens]


@pytest.fixture(scope="module")
def synthetic():
    rng = np.random.default_rng(7)
    V = 8
    p = rng.dirichlet(np.full(V, 5.0), size=3)  # target rows for positions 0, 1, 2
    q = rng.dirichlet(np.full(V, 5.0), size=2)  # a draft that differs from it
    return p, q


def _first_two(rule, p, q, n=60_000, seed=0):
    """Joint counts of the first two generated tokens (V*V cells)."""
    rng = np.random.default_rng(seed)
    V = p.shape[1]
    counts = np.zeros(V * V)
    for _ in range(n):
        a, b = _generate(rule, p, q, rng, 2)
        counts[a * V + b] += 1
    return counts


def test_acceptance_rule_reproduces_the_target_distribution(synthetic):
    p, q = synthetic
    # With position-independent rows the joint is p0 x p1 whatever was accepted.
    expected = np.outer(p[0], p[1]).ravel()
    assert chi_square_p(_first_two(accept_sampling, p, q), expected) > 1e-3


@pytest.mark.parametrize("broken", [resample_from_p, ignore_q])
def test_acceptance_test_rejects_broken_rules(synthetic, broken):
    p, q = synthetic
    expected = np.outer(p[0], p[1]).ravel()
    assert chi_square_p(_first_two(broken, p, q), expected) < 1e-6


def test_bonus_token_is_sampled_from_the_target(synthetic):
    """After K accepted drafts the (K+1)-th token comes from p[K]; a rule that skips it fails."""
    p, q = synthetic
    V = p.shape[1]

    def third(rule):
        rng = np.random.default_rng(3)
        counts = np.zeros(V)
        for _ in range(40_000):
            counts[_generate(rule, p, q, rng, 3)[2]] += 1
        return counts

    assert chi_square_p(third(accept_sampling), p[2]) > 1e-3
    assert chi_square_p(third(skip_bonus), p[2]) < 1e-6


def test_point_mass_proposals_are_lossless(synthetic):
    """n-gram / suffix proposals (q = None): the output is still exactly p."""
    p, _ = synthetic
    rng = np.random.default_rng(5)
    V = p.shape[1]
    counts = np.zeros(V)
    for _ in range(40_000):
        n, nxt = accept_sampling(p, None, [3], rng)
        counts[3 if n == 1 else nxt] += 1
    assert chi_square_p(counts, p[0]) > 1e-3


# ---------------------------------------------------------------- end to end on the model
def warped_probabilities(logits, ids: list[int], sp: SamplingParams) -> np.ndarray:
    """The next-token distribution of [1, vocab] logits under transformers' own warpers."""
    import torch
    from transformers import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    warpers = LogitsProcessorList([TemperatureLogitsWarper(sp.temperature)])
    if sp.top_k:
        warpers.append(TopKLogitsWarper(sp.top_k))
    if sp.top_p < 1:
        warpers.append(TopPLogitsWarper(sp.top_p))
    scores = warpers(torch.tensor([ids]), torch.as_tensor(logits).double())
    return torch.softmax(scores, dim=-1)[0].numpy()


def hf_probabilities(model, ids: list[int], sp: SamplingParams) -> np.ndarray:
    """The next-token distribution by transformers' own logits and warpers."""
    import torch

    with torch.no_grad():
        return warped_probabilities(model(torch.tensor([ids])).logits[:, -1], ids, sp)


class OwnTarget:
    """The oracle for a quantized target: the distribution of the target the bundle runs
    (its int4 weights, not the float32 model's), read from one target-only prefill of the
    context in a generator of its own and put through transformers' warpers. The engine's
    acceptance rule and verify windows are not involved."""

    def __init__(self, bundle: Path):
        self.gen = qpcbuild.load(bundle)

    def __call__(self, ids: list[int], sp: SamplingParams) -> np.ndarray:
        from qpcbuild.numerics_bench import teacher_forced_logits

        logits = teacher_forced_logits(self.gen, ids, [0], 1)[:1]  # the row after the context
        return warped_probabilities(logits, ids, sp)


# 8 rows per call; a 64-slot context holds the prompt and the few new tokens, and makes each of
# the 200 calls per test about 2x cheaper than the recipe's 512 (the distributions are the same).
SAMPLING_SHAPES = ("shapes.batch_size=8", "shapes.ctx_len=64")


@pytest.fixture(scope="module")
def sampling_bundle(tmp_path_factory) -> Path:
    return build(tmp_path_factory, "demo.yaml", *SAMPLING_SHAPES)


@pytest.fixture(scope="module")
def subset_sampling_bundle(tmp_path_factory) -> Path:
    """A draft whose q is 0 for every third token: the rule must still give exactly p."""
    return build(tmp_path_factory, "demo.yaml", *SAMPLING_SHAPES, SUBSET)


CODE_TEXT = "def read_config(path):\n    with open(path) as f:\n"


def joint_p_value(bundle: Path, oracle, sp: SamplingParams, text: str = CODE_TEXT) -> float:
    """Chi-square p-value of the joint of the first two generated tokens (the first sampled
    after prefill, the second through a draft proposal and the acceptance rule) against the
    oracle's distribution (a transformers model, or `OwnTarget`), with cells pooled so that
    each expects >= 5 samples."""
    probs_of = oracle if isinstance(oracle, OwnTarget) else \
        (lambda ids, sp: hf_probabilities(oracle, ids, sp))
    gen = qpcbuild.load(bundle)
    prompt = gen.encode(text)
    first = int(np.argmax(probs_of(prompt, SamplingParams(1.0))))
    ctx = prompt + [first]
    p2 = probs_of(ctx, sp)
    seqs: dict[tuple[int, int], int] = {}
    n = 0
    for seed in range(200):
        rows = gen.generate([ctx] * 8, max_new_tokens=3, temperature=sp.temperature,
                            top_k=sp.top_k, top_p=sp.top_p, seed=seed).rows
        for r in rows:
            a, b = (r.tokens[len(ctx):len(ctx) + 2] + [-1])[:2]  # -1: stopped at an EOS
            seqs[(a, b)] = seqs.get((a, b), 0) + 1
            n += 1
    # Expected joint: p(a) p(b | a) for the likely a's; everything else in one pooled cell.
    cells, probs = [], []
    for a in np.argsort(-p2)[:6]:
        if int(a) in gen.eos_ids:  # generation stops there: its mass stays in the pooled cell
            continue
        pb = probs_of(ctx + [int(a)], sp)
        for b in np.argsort(-pb)[:6]:
            if p2[a] * pb[b] * n >= 5:
                cells.append((int(a), int(b)))
                probs.append(p2[a] * pb[b])
    assert len(cells) >= 4, "the distribution is too flat for this prompt to test anything"
    observed = [seqs.get(c, 0) for c in cells]
    rest_count, rest_prob = n - sum(observed), 1 - sum(probs)
    if rest_prob * n >= 5:
        observed.append(rest_count)
        probs.append(rest_prob)
    else:  # (top-k leaves too little outside the cells) pool the rest into the last cell
        observed[-1] += rest_count
        probs[-1] += rest_prob
    return chi_square_p(np.array(observed, float), np.array(probs))


@pytest.mark.parametrize("sp", [SamplingParams(0.7), SamplingParams(1.3),
                                SamplingParams(1.0, top_k=5), SamplingParams(1.0, top_p=0.8)],
                         ids=["t0.7", "t1.3", "top_k5", "top_p0.8"])
def test_speculative_sampling_matches_transformers_distribution(sp, sampling_bundle, hf_target):
    assert joint_p_value(sampling_bundle, hf_target, sp) > 1e-3


def test_speculative_sampling_with_a_vocabulary_subset_draft(subset_sampling_bundle, hf_target,
                                                             monkeypatch):
    assert joint_p_value(subset_sampling_bundle, hf_target, SamplingParams(1.0)) > 1e-3
    monkeypatch.setattr(engine, "accept_sampling", ignore_q)
    assert joint_p_value(subset_sampling_bundle, hf_target, SamplingParams(1.0)) < 1e-3


@pytest.mark.parametrize("broken,temperature", [(ignore_q, 0.7), (ignore_q, 1.3),
                                                (resample_from_p, 0.7)])
def test_the_model_level_test_rejects_broken_rules(broken, temperature, sampling_bundle,
                                                   hf_target, monkeypatch):
    """The demo draft is distilled from the target (q close to p), so resampling from p
    deviates too little to see at 1,600 samples at T=1.3; at T=0.7 it is seen."""
    monkeypatch.setattr(engine, "accept_sampling", broken)
    assert joint_p_value(sampling_bundle, hf_target, SamplingParams(temperature)) < 1e-3


@pytest.fixture(scope="module")
def int4_target_bundle(tmp_path_factory) -> Path:
    """An int4 target and an int4 draft: speculation must reproduce the int4 target's own
    distribution, which is not the float32 model's."""
    return build(tmp_path_factory, "demo.yaml", *SAMPLING_SHAPES,
                 "onnxruntime.target_weights=int4", "onnxruntime.draft_weights=int4")


def test_int4_target_sampling_matches_its_own_distribution(int4_target_bundle, monkeypatch):
    own = OwnTarget(int4_target_bundle)
    assert joint_p_value(int4_target_bundle, own, SamplingParams(1.0)) > 1e-3
    monkeypatch.setattr(engine, "accept_sampling", ignore_q)  # the broken variant is seen
    assert joint_p_value(int4_target_bundle, own, SamplingParams(1.0)) < 1e-3


# ---------------------------------------------------------------- turbo heads
@pytest.fixture(scope="module")
def turbo_sampling_bundle(tmp_path_factory) -> Path:
    """The demo target with untrained heads: their softmax overlaps the target's next-token
    distribution without being it, so a rule that mishandles q shows (on TURBO_TEXT, where
    the two distributions of the test's second token differ most among the prompts tried: a
    rule that ignores q moves about 0.1 of its probability, computed from transformers)."""
    return build(tmp_path_factory, "demo.yaml", *SAMPLING_SHAPES, UNTRAINED_TURBO)


def argmax_with_softmax_q(rows, room):
    """Broken: each head proposes its argmax but reports its softmax as q (the proposal was
    not drawn from the q the rule divides by)."""
    proposals, q = heads.propose_from_heads(rows, room)
    for i, r in enumerate(rows):
        if r.head_logits is not None:
            proposals[i] = [int(x.argmax()) for x in r.head_logits[:len(proposals[i])]]
    return proposals, q


TURBO_TEXT = "# # # # # # # # # # #"


def test_turbo_sampling_matches_transformers_distribution(turbo_sampling_bundle, hf_target,
                                                          monkeypatch):
    """At T = 1.0 the heads' softmax is the draft distribution: exact; and the test rejects a
    rule that ignores q and heads whose proposals were not drawn from the reported q."""
    sp = SamplingParams(1.0)
    assert joint_p_value(turbo_sampling_bundle, hf_target, sp, TURBO_TEXT) > 1e-3
    with monkeypatch.context() as patch:
        patch.setattr(engine, "accept_sampling", ignore_q)
        assert joint_p_value(turbo_sampling_bundle, hf_target, sp, TURBO_TEXT) < 1e-3
    monkeypatch.setattr(engine, "propose_from_heads", argmax_with_softmax_q)
    assert joint_p_value(turbo_sampling_bundle, hf_target, sp, TURBO_TEXT) < 1e-3


# ---------------------------------------------------------------- EAGLE-3 heads
@pytest.fixture(scope="module")
def eagle3_sampling_bundle(tmp_path_factory) -> Path:
    """The demo target with a head that is the target minus its last layers (its softmax
    overlaps the target's, without being it) over a draft vocabulary without every third
    token: q is zero outside it."""
    head = tmp_path_factory.getbasetemp() / "demo-eagle3-shortcut"
    if not head.is_dir():
        write_shortcut_eagle3_head(head, DEMO / "target")
    return build(tmp_path_factory, "demo.yaml", *SAMPLING_SHAPES, "draft.method=eagle3",
                 f"draft.model={head}", "speculation.num_speculative_tokens=[0,3]",
                 "onnxruntime.graph=portable")


def argmax_with_softmax_q_eagle3(self, r, draft_logits, probs):
    """Broken: the head proposes its argmax but reports its softmax as q."""
    return int(probs.argmax()) if probs is not None else ORIGINAL_CHOOSE(self, r, draft_logits,
                                                                         probs)


ORIGINAL_CHOOSE = eagle3.Eagle3Drafter._choose


@pytest.mark.slow
def test_eagle3_sampling_matches_transformers_distribution(eagle3_sampling_bundle, hf_target,
                                                           monkeypatch):
    """At T = 1.0 the head's softmax over the target vocabulary (zero outside its draft
    vocabulary) is the draft distribution: exact; and the test rejects a rule that ignores q
    and a head whose proposals were not drawn from the reported q. Slow (about 100 s on a
    shared 2-core machine): three runs of 1,600 sampled continuations, the head called per
    row and per drafted token."""
    sp = SamplingParams(1.0)
    assert joint_p_value(eagle3_sampling_bundle, hf_target, sp, TURBO_TEXT) > 1e-3
    with monkeypatch.context() as patch:
        patch.setattr(engine, "accept_sampling", ignore_q)
        assert joint_p_value(eagle3_sampling_bundle, hf_target, sp, TURBO_TEXT) < 1e-3
    monkeypatch.setattr(eagle3.Eagle3Drafter, "_choose", argmax_with_softmax_q_eagle3)
    assert joint_p_value(eagle3_sampling_bundle, hf_target, sp, TURBO_TEXT) < 1e-3


@pytest.mark.slow
def test_a_confidence_stopped_head_samples_exactly(tmp_path_factory, hf_target, monkeypatch):
    """speculation.draft_p_min with an EAGLE-3 head at T = 1.0. A shortcut head that also reads
    the token (its softmax overlaps the target's and depends on the first sampled token): its
    largest probability at the first draft position lies above the threshold after some first
    tokens and below it after others, so rows stop and rows propose in one run. The joint stays
    the target's, and the same run with a rule that ignores q is rejected. Slow (about 70 s):
    two runs of 1,600 sampled continuations."""
    head = tmp_path_factory.getbasetemp() / "demo-eagle3-shortcut-token"
    if not head.is_dir():
        write_shortcut_eagle3_head(head, DEMO / "target", token_weight=0.5)
    bundle = build(tmp_path_factory, "demo.yaml", *SAMPLING_SHAPES, "draft.method=eagle3",
                   f"draft.model={head}", "speculation.num_speculative_tokens=[0,1,2,3]",
                   "speculation.draft_p_min=0.165", "onnxruntime.graph=portable")
    gen = qpcbuild.load(bundle)
    prompt = gen.encode(TURBO_TEXT)
    ctx = prompt + [int(np.argmax(hf_probabilities(hf_target, prompt, SamplingParams(1.0))))]
    proposed = [r.stats.num_draft_tokens > 0 for seed in range(4) for r in gen.generate(
        [ctx] * 8, max_new_tokens=3, temperature=1.0, seed=seed).rows]
    assert any(proposed) and not all(proposed), proposed  # both kinds of row in one run
    sp = SamplingParams(1.0)
    assert joint_p_value(bundle, hf_target, sp, TURBO_TEXT) > 1e-3
    monkeypatch.setattr(engine, "accept_sampling", ignore_q)
    assert joint_p_value(bundle, hf_target, sp, TURBO_TEXT) < 1e-3

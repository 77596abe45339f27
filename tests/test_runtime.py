"""The runtime loop against its oracles: target-only greedy decoding (token for token) and the
target's own sampling distribution (chi-square), on bundles built from the shipped demo pair."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import qpcbuild
from qpcbuild.bundle import build_bundle
from qpcbuild.cache import Cache
from qpcbuild.cli import app
from qpcbuild.errors import BundleError, UsageError
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


def build(tmp_factory, name: str, recipe: str = "recipes/demo.yaml", overrides=()) -> Path:
    out = tmp_factory.mktemp(name) / "bundle"
    r = load_recipe(ROOT / recipe, list(overrides))
    build_bundle(make_plan(r), cache=Cache(tmp_factory.getbasetemp() / "cache"), out=out)
    return out


@pytest.fixture(scope="module")
def bundle_k_list(tmp_path_factory) -> Path:
    """Batch 1, Ks [0, 1, 3, 4] so every method and several K can be checked on one bundle."""
    return build(tmp_path_factory, "klist", overrides=["speculation.num_speculative_tokens=[0,1,3,4]"])


@pytest.fixture(scope="module", params=["fused", "portable"])
def bundle_batch(tmp_path_factory, request) -> Path:
    """Batch 4 and a short context, so rows hit ctx_len and finish at different times; built
    with the fused graph (run once per row over that row's KV) and with the portable one (all
    rows in one call)."""
    return build(tmp_path_factory, f"batch-{request.param}", overrides=[
        "shapes.batch_size=4", "shapes.ctx_len=160", f"onnxruntime.graph={request.param}",
        "speculation.num_speculative_tokens=[0,4]"])


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    lines = (DEMO / "eval_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines][:20]


def _tokens(result) -> list[list[int]]:
    return [r.tokens[len(r.prompt):] for r in result.rows]


# ---------------------------------------------------------------- greedy is exact
@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "ngram", "suffix"])
def test_greedy_speculative_output_equals_target_only_for_every_compiled_k(bundle_k_list, prompts,
                                                                           method):
    for k in (1, 3, 4):
        gen = qpcbuild.load(bundle_k_list, method=method, k=k, verify="none")
        for p in prompts:
            spd = gen.generate([p], max_new_tokens=48)
            base = gen.generate([p], max_new_tokens=48, target_only=True)
            assert _tokens(spd) == _tokens(base), (method, k, p[:40])
            assert len(gen.encode(p)) > 32  # longer than one prefill chunk


def test_fused_ort_lowering_gives_the_tokens_of_the_portable_graph(tmp_path_factory, bundle_k_list,
                                                                  prompts):
    """The ORT backend's fused graph (GQA kernels, in-place KV) against the portable graph the
    card compiles, run through the same loop: identical greedy tokens."""
    portable = build(tmp_path_factory, "portable", overrides=[
        "speculation.num_speculative_tokens=[0,1,3,4]", "onnxruntime.graph=portable"])
    fused_gen = qpcbuild.load(bundle_k_list, verify="none")
    portable_gen = qpcbuild.load(portable, verify="none")
    assert fused_gen.manifest.target.backends["onnxruntime"].graph == "fused"
    assert portable_gen.manifest.target.backends["onnxruntime"].graph == "portable"
    for p in prompts[:8]:
        assert _tokens(fused_gen.generate([p], max_new_tokens=48)) == \
            _tokens(portable_gen.generate([p], max_new_tokens=48))
    ids = np.array([fused_gen.encode(prompts[0])[:32]])
    pos = np.arange(32)[None]
    np.testing.assert_allclose(fused_gen.target.run(ids, pos), portable_gen.target.run(ids, pos),
                               atol=1e-4)


def _matmul_nbits(x: np.ndarray, q: np.ndarray, scale: np.ndarray, k: int, n: int) -> np.ndarray:
    """ONNX Runtime's own MatMulNBits (fp32 activations) on our packed weights."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", K=k,
                            N=n, bits=8, block_size=32, accuracy_level=0)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(q, "q"), numpy_helper.from_array(scale, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("k", [64, 72])  # 72: a last block padded with zeros
def test_int8_weight_packing_is_what_onnxruntime_reads(k):
    from qpcbuild.backends.onnxruntime.nbits import blockwise_int8

    rng = np.random.default_rng(0)
    w = rng.normal(size=(k, 48)).astype(np.float32)
    w[:32, 3] = 0.0  # an all-zero block
    x = rng.normal(size=(2, k)).astype(np.float32)
    q, scale = blockwise_int8(w)
    deq = (q.astype(np.float32) - 128) * scale.reshape(48, -1, 1)
    deq = deq.reshape(48, -1)[:, :k].T
    assert np.max(np.abs(deq - w)) <= np.max(scale) / 2 + 1e-7  # round to nearest
    np.testing.assert_allclose(_matmul_nbits(x, q, scale, k, 48), x @ deq, rtol=1e-5, atol=1e-4)
    # The same bytes read in the other orientation are a different matrix: the check can fail.
    swapped = q.reshape(48, -1)[::-1].reshape(q.shape).copy()
    assert not np.allclose(_matmul_nbits(x, swapped, scale, k, 48), x @ deq, atol=1e-2)


def test_int8_draft_weights_change_the_proposals_never_the_output(tmp_path_factory, prompts):
    import onnx

    out = build(tmp_path_factory, "int8", overrides=["onnxruntime.draft_weights=int8"])
    gen = qpcbuild.load(out, verify="none")
    ort_info = gen.manifest.to_json_dict()["roles"]["draft"]["backends"]["onnxruntime"]
    assert ort_info["weights"] == "int8"
    assert gen.manifest.target.backends["onnxruntime"].weights == "float32"
    graph = onnx.load(str(out / ort_info["artifact"]), load_external_data=False).graph
    ops = Counter(n.op_type for n in graph.node)
    assert ops["MatMulNBits"] == 4 * 2 + 1 and ops["MatMul"] == 0, ops  # 4 per layer + lm_head
    accepted = 0
    for p in prompts[:8]:
        spd = gen.generate([p], max_new_tokens=48)
        assert _tokens(spd) == _tokens(gen.generate([p], max_new_tokens=48, target_only=True))
        accepted += spd.stats.num_accepted_tokens
    assert accepted > 0


def test_draft_model_accepts_tokens_and_stats_are_consistent(bundle_k_list, prompts):
    gen = qpcbuild.load(bundle_k_list, method="draft_model", k=4, verify="none")
    totals = Counter()
    for p in prompts[:5]:
        st = gen.generate([p], max_new_tokens=48).stats
        assert st.num_accepted_tokens <= st.num_draft_tokens
        per_pos = st.accepted_per_pos
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # acceptance is a prefix
        assert sum(per_pos) == st.num_accepted_tokens
        assert st.mean_acceptance_length == pytest.approx(
            1 + st.num_accepted_tokens / st.num_drafts, abs=1e-3)
        totals.update(accepted=st.num_accepted_tokens, calls=st.target_calls,
                      new=st.new_tokens)
    assert totals["accepted"] > 0
    assert totals["new"] / totals["calls"] > 1.5  # speculation actually saves target calls


def test_batch_rows_match_single_row_decoding_and_hit_ctx_len(bundle_batch, prompts):
    gen = qpcbuild.load(bundle_batch, verify="none")
    batch = prompts[:4]
    out = gen.generate(batch, max_new_tokens=200)  # more than ctx_len allows
    reasons = {r.finish_reason for r in out.rows}
    assert "ctx_len" in reasons or "eos" in reasons
    for i, p in enumerate(batch):
        single = gen.generate([p], max_new_tokens=200, target_only=True)
        assert _tokens(out)[i] == _tokens(single)[0]
        assert len(out.rows[i].tokens) <= 160
    uneven = gen.generate([prompts[0][:40], prompts[1]], max_new_tokens=30)
    for i, p in enumerate([prompts[0][:40], prompts[1]]):
        assert _tokens(uneven)[i] == _tokens(gen.generate([p], max_new_tokens=30,
                                                          target_only=True))[0]


def test_generation_that_reaches_the_last_context_slot_stays_exact(bundle_batch, prompts):
    """Windows and prefill chunks near the end of the buffer are shifted over tokens already
    sent instead of padded past it (engine._verify, engine._chunk_starts)."""
    _reaches_the_last_slot(bundle_batch, 160, prompts)


def test_a_batch_1_generation_that_reaches_the_last_context_slot_stays_exact(bundle_k_list,
                                                                             prompts):
    _reaches_the_last_slot(bundle_k_list, 512, prompts)


def _reaches_the_last_slot(bundle: Path, ctx: int, prompts: list[str]) -> None:
    for method in ("draft_model", "ngram"):
        gen = qpcbuild.load(bundle, method=method, verify="none")
        for n in range(4):
            ids = [t for p in prompts[n:] for t in gen.encode(p)][:ctx - 10]
            assert len(ids) == ctx - 10
            spd = gen.generate([ids], max_new_tokens=50)
            base = gen.generate([ids], max_new_tokens=50, target_only=True)
            assert _tokens(spd) == _tokens(base)
            assert len(spd.rows[0].tokens) == ctx or spd.rows[0].finish_reason == "eos"


@pytest.mark.parametrize("graph", ["fused", "portable"])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_continuous_batching_refills_slots_and_keeps_every_request_exact(tmp_path_factory,
                                                                         bundle_k_list, prompts,
                                                                         method, graph):
    """7 requests through 3 KV slots: each finished slot is prefilled with the next request
    (batch_index), and every request still gets exactly its target-only greedy tokens; with
    the fused graph run once per live row, and with the portable graph the card compiles."""
    cb = build(tmp_path_factory, f"cb-{method}-{graph}", overrides=[
        "shapes.full_batch_size=3", "speculation.num_speculative_tokens=[0,4]",
        f"onnxruntime.graph={graph}"])
    gen = qpcbuild.load(cb, method=method, verify="none")
    assert gen.decoder.cb and gen.target.batch_size == 3
    reference = qpcbuild.load(bundle_k_list, verify="none")
    batch = prompts[:7]
    out = gen.generate(batch, max_new_tokens=40)
    assert len(out.rows) == 7
    for i, p in enumerate(batch):
        assert _tokens(out)[i] == _tokens(reference.generate([p], max_new_tokens=40,
                                                             target_only=True))[0], i
    # the slots were shared: fewer verify calls than 7 requests decoded one after another
    assert out.stats.target_calls < sum(r.stats.target_calls for r in out.rows)
    # requests that end at their first token still free their slot for the next ones
    one = gen.generate(batch, max_new_tokens=1)
    assert [len(t) for t in _tokens(one)] == [1] * 7


def test_a_fused_cb_session_runs_only_rows_with_tokens_in_their_own_kv_rows(tmp_path_factory,
                                                                            prompts):
    """One request in a bundle of 4 slots: the graph writes slot 0's KV rows in place (views
    of the preallocated buffers). Windows never run the free slots; a single-token call may go
    through the graph for every slot at once, and then writes the free slots only at their last
    position, which a row overwrites before it reads it."""
    cb = build(tmp_path_factory, "cb-rows", overrides=["shapes.full_batch_size=4"])
    gen = qpcbuild.load(cb, verify="none")
    assert type(gen.target).__name__ == "RowwiseOrtSession" and gen.target.batch_size == 4
    buffers = gen.target.kv_buffers[0]
    before = [id(b) for b in buffers]
    calls = []
    real = gen.target.sess.run_with_iobinding
    gen.target.sess.run_with_iobinding = lambda b: (calls.append(b), real(b))[1]
    gen.generate([prompts[0]], max_new_tokens=12, target_only=True)
    assert [id(b) for b in gen.target.kv_buffers[0]] == before
    assert all(b[0].any() and not b[1:, :, :-1].any() for b in buffers)
    # one call per prefill chunk and per decode step: row by row for the one live row (the
    # session measured it cheaper than a call over all 4), or once for all slots
    assert len(calls) == gen.generate([prompts[0]], max_new_tokens=12,
                                      target_only=True).stats.target_calls


def test_what_only_the_fused_graph_has_works_under_continuous_batching(tmp_path_factory,
                                                                       prompts):
    """The card's formats emulated and int8 draft weights, with 3 KV slots: each request gets
    the tokens the batch-1 bundle gives it (the same graph runs, once per row), and the int8
    draft still leaves the output exactly the target's."""
    card = ["precision.quantization=mxfp6", "precision.kv_cache_dtype=mxint8",
            "onnxruntime.draft_weights=int8", "speculation.num_speculative_tokens=[0,4]"]
    cb = qpcbuild.load(build(tmp_path_factory, "cb-card", overrides=[
        *card, "shapes.full_batch_size=3"]), verify="none")
    single = qpcbuild.load(build(tmp_path_factory, "single-card", overrides=card),
                           verify="none")
    assert cb.manifest.target.backends["onnxruntime"].numerics == "emulated"
    batch = prompts[:5]
    spec, plain = cb.generate(batch, max_new_tokens=24), cb.generate(batch, max_new_tokens=24,
                                                                     target_only=True)
    assert spec.stats.num_accepted_tokens > 0
    for i, p in enumerate(batch):
        alone = _tokens(single.generate([p], max_new_tokens=24, target_only=True))[0]
        assert _tokens(plain)[i] == _tokens(spec)[i] == alone, i


def test_kv_cache_lives_in_preallocated_buffers(bundle_k_list, prompts):
    gen = qpcbuild.load(bundle_k_list, verify="none")
    before = [id(b) for side in gen.target.kv_buffers for b in side]
    assert not any(b.any() for side in gen.target.kv_buffers for b in side)
    gen.generate([prompts[0]], max_new_tokens=8)
    assert [id(b) for side in gen.target.kv_buffers for b in side] == before
    assert all(b.any() for b in gen.target.kv_buffers[0])  # written in place by the graph


# Sampling is checked against transformers' own distribution in test_oracles.py.


# ---------------------------------------------------------------- bad input
runner = CliRunner()


def test_run_cli_reports_stats_and_baseline_match(bundle_k_list):
    res = runner.invoke(app, ["run", str(bundle_k_list), "--prompt", "def add(a, b):\n",
                              "--max-new-tokens", "24", "--compare-baseline", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["baseline"]["outputs_match"] is True
    stats = report["batches"][0]["stats"]
    assert stats["new_tokens"] == 24 and stats["target_calls"] <= 24


@pytest.mark.parametrize("args, code, needle", [
    (["--prompt", ""], 2, "empty"),
    (["--prompt", "x", "--max-new-tokens", "0"], 2, "max-new-tokens"),
    (["--prompt", "x", "--temperature", "-1"], 2, "temperature"),
    (["--prompt", "x", "--k", "7"], 2, "not compiled"),
    (["--prompt", "x", "--method", "beam"], 2, "unknown method"),
    (["--prompt", "x", "--backend", "qaic"], 1, "not built for backend"),
    (["--prompt", "x " * 600], 2, "ctx_len"),
    (["--prompt", "x", "--ctx-len", "4096"], 1, "compiled for ctx_len=512"),
    (["--prompt", "x", "--batch-size", "8"], 1, "compiled for batch_size=1"),
    ([], 2, "--prompt"),
])
def test_run_cli_rejects_bad_input_with_a_clear_message(bundle_k_list, args, code, needle):
    res = runner.invoke(app, ["run", str(bundle_k_list), *args])
    assert res.exit_code == code, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_run_cli_rejects_non_utf8_prompt_file(bundle_k_list, tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"\xff\xfe bad")
    res = runner.invoke(app, ["run", str(bundle_k_list), "--prompt-file", str(f)])
    assert res.exit_code == 2 and "UTF-8" in res.output


def test_too_many_prompts_for_the_compiled_batch_is_refused(bundle_k_list):
    gen = qpcbuild.load(bundle_k_list, verify="none")
    with pytest.raises(UsageError, match="batch size 1"):
        gen.generate(["a", "b"], max_new_tokens=4)


def test_corrupted_bundle_is_refused_with_the_file_named(tmp_path_factory):
    bundle = build(tmp_path_factory, "corrupt")
    data = bundle / "draft" / "ort" / "model.onnx.data"
    data.chmod(0o644)
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.unlink()  # break the hard link to the cache before writing
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="draft/ort/model.onnx.data"):
        qpcbuild.load(bundle)
    res = runner.invoke(app, ["run", str(bundle), "--prompt", "x"])
    assert res.exit_code == 1 and "model.onnx.data" in res.output

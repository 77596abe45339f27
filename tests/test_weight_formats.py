"""Per-role weight formats on ONNX Runtime (onnxruntime.draft_weights / target_weights): the
MatMulNBits packing against a numpy dequantization written from the contrib op's specification
(B: uint8 [N, ceil(K/block), block * bits / 8], codes packed low bits first along K; value =
(code - zero_point) * scale with the default zero point 2^(bits-1); scales [N * blocks])."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from qpcbuild.backends.onnxruntime.nbits import blockwise_nbits, blockwise_nbits_asymmetric

from helpers_nbits import ort_matmul_nbits, spec_dequantize


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block,k", [(64, 200), (128, 300)])  # 3 blocks: an odd zero-point nibble
def test_asymmetric_blocks_read_as_the_spec_says(bits, block, k):
    rng = np.random.default_rng(bits + block)
    n = 10
    w = (rng.normal(size=(k, n)) + 0.7).astype(np.float32)  # skewed: the asymmetric grid's case
    x = rng.normal(size=(2, k)).astype(np.float32)
    packed, scales, zeros = blockwise_nbits_asymmetric(w, bits, block)
    blocks = -(-k // block)
    assert packed.shape == (n, blocks, block * bits // 8)
    assert zeros.shape == (n * -(-blocks * bits // 8),)
    deq = spec_dequantize(packed, scales, bits, k, zeros)
    step = np.repeat(scales.reshape(n, -1), block, axis=1)[:, :k].T
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-5)
    # finer than the symmetric grid of the same bits on these weights
    sym = spec_dequantize(*blockwise_nbits(w, bits, block), bits, k)
    assert np.abs(deq - w).mean() < np.abs(sym - w).mean()
    got = ort_matmul_nbits(x, packed, scales, k, n, bits, 0, block, zeros)
    np.testing.assert_allclose(got, x.astype(np.float64) @ deq, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 72])  # 72: the last block padded with zeros
def test_matmul_nbits_reads_the_packing_as_the_spec_says(bits, k):
    rng = np.random.default_rng(bits * 100 + k)
    n = 24
    w = rng.normal(size=(k, n)).astype(np.float32)
    w[:32, 5] = 0.0  # an all-zero block
    x = rng.normal(size=(3, k)).astype(np.float32)
    packed, scales = blockwise_nbits(w, bits)
    assert packed.shape == (n, -(-k // 32), 32 * bits // 8) and packed.dtype == np.uint8
    deq = spec_dequantize(packed, scales, bits, k)
    # round to nearest on a symmetric grid of 2^(bits-1) - 1 steps per block's absmax
    step = np.repeat(scales.reshape(n, -1), 32, axis=1)[:, :k].T
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-6)
    assert np.all(deq[:32, 5] == 0.0)
    ref = x.astype(np.float64) @ deq
    # accuracy_level 0: float math on the dequantized weights
    np.testing.assert_allclose(ort_matmul_nbits(x, packed, scales, k, n, bits, 0), ref,
                               rtol=1e-4, atol=1e-4)
    # accuracy_level 4 (what qpcbuild's graphs use): activations quantized to int8 per block
    got = ort_matmul_nbits(x, packed, scales, k, n, bits, 4)
    assert np.max(np.abs(got - ref)) < 0.02 * np.max(np.abs(ref))


def test_the_spec_reference_tells_the_nibble_order_apart():
    """The reference is not vacuous: high-nibble-first bytes are another matrix."""
    rng = np.random.default_rng(7)
    w = rng.normal(size=(64, 8)).astype(np.float32)
    packed, scales = blockwise_nbits(w, 4)
    swapped = ((packed >> 4) | (packed << 4)).astype(np.uint8)
    x = rng.normal(size=(2, 64)).astype(np.float32)
    right = x @ spec_dequantize(packed, scales, 4, 64)
    got = ort_matmul_nbits(x, swapped, scales, 64, 8, 4, 0)
    assert not np.allclose(got, right, atol=1e-2)


# ---------------------------------------------------------------- on the demo pair
ROOT = Path(__file__).resolve().parents[1]
DEMO_RECIPE = ROOT / "recipes" / "demo.yaml"


def _build(tmp_path: Path, *overrides: str) -> Path:
    from qpcbuild.bundle import build_bundle
    from qpcbuild.cache import Cache
    from qpcbuild.plan import make_plan
    from qpcbuild.recipe import load_recipe

    out = tmp_path / "bundle"
    build_bundle(make_plan(load_recipe(DEMO_RECIPE, list(overrides))),
                 cache=Cache(tmp_path / "cache"), out=out)
    return out


def _bits_of(bundle: Path, role: str) -> Counter:
    import onnx

    graph = onnx.load(str(bundle / role / "ort" / "model.onnx"), load_external_data=False).graph
    return Counter(next((a.i for a in n.attribute if a.name == "bits"), 32)
                   for n in graph.node if n.op_type in ("MatMul", "MatMulNBits"))


@pytest.fixture(scope="module")
def int4_target(tmp_path_factory) -> Path:
    """The demo pair with an int4 target and an int4 draft (what recipes/smollm2-int4.yaml asks)."""
    return _build(tmp_path_factory.mktemp("int4"), "onnxruntime.draft_weights=int4",
                  "onnxruntime.target_weights=int4")


def test_int4_draft_is_lossless_and_int4_target_is_labelled(tmp_path):
    import qpcbuild
    from qpcbuild.cli import app

    out = _build(tmp_path, "onnxruntime.draft_weights=int4", "onnxruntime.target_weights=int8")
    for role, bits in (("draft", 4), ("target", 8)):
        layers = json.loads((ROOT / "models" / "demo" / role / "config.json").read_text())[
            "num_hidden_layers"]
        assert _bits_of(out, role) == Counter({bits: 4 * layers + 1})  # 4 a layer + the head
    gen = qpcbuild.load(out, verify="none")
    for prompt in ("def add(a, b):", "The capital of"):
        spd = gen.generate([prompt], max_new_tokens=32).rows[0].tokens
        assert spd == gen.generate([prompt], max_new_tokens=32, target_only=True).rows[0].tokens
    res = CliRunner().invoke(app, ["run", str(out), "--prompt", "def f(", "--max-new-tokens",
                                   "4", "--json"])
    assert res.exit_code == 0, res.output
    numerics = json.loads(res.stdout)["numerics"]
    assert numerics["draft"]["matmul_weights"] == "int4"
    assert numerics["target"]["matmul_weights"] == "int8"
    text = CliRunner().invoke(app, ["run", str(out), "--prompt", "def f(", "--max-new-tokens", "4"])
    assert "OUTPUT differs from the float32 target" in text.output


def test_the_manifest_records_the_int4_target(int4_target):
    roles = json.loads((int4_target / "manifest.json").read_text())["roles"]
    assert roles["target"]["backends"]["onnxruntime"]["weights"] == "int4"
    assert roles["draft"]["backends"]["onnxruntime"]["weights"] == "int4"


def test_int4_target_speculation_equals_its_own_target_only(int4_target):
    """Lossless relative to the target the bundle runs (not to the float32 model): greedy
    draft_model output is token for token the int4 target's own target-only output, on every
    demo evaluation prompt."""
    import qpcbuild

    gen = qpcbuild.load(int4_target, verify="none")
    prompts = [json.loads(line)["text"] for line in
               (ROOT / "models" / "demo" / "eval_prompts.jsonl").read_text().splitlines()][:6]
    accepted = 0
    for prompt in prompts:
        spd = gen.generate([prompt], max_new_tokens=40)
        base = gen.generate([prompt], max_new_tokens=40, target_only=True)
        assert spd.rows[0].tokens == base.rows[0].tokens, prompt
        accepted += spd.stats.num_accepted_tokens
    assert accepted > 0  # the draft's proposals were used, not all rejected


def test_bench_labels_an_int4_target(int4_target, tmp_path):
    from qpcbuild.bench.report import markdown_table
    from qpcbuild.cli import app

    js = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", str(int4_target), "--peers", "none", "--ks", "4",
                                   "--max-new-tokens", "4", "--repeats", "1", "--num-prompts",
                                   "1", "--json-out", str(js), "--no-plot"])
    assert res.exit_code == 0, res.output
    assert "INT4 TARGET (not float32)" in res.output
    report = json.loads(js.read_text())
    assert report["settings"]["target_weights"] == "int4"
    assert report["notes"][0].startswith("target weights int4 blocks (not the float32 target")
    assert markdown_table(report).startswith("target: INT4 TARGET (not float32)")


def test_serve_model_card_labels_an_int4_target(int4_target):
    import httpx

    from helpers_server import LiveServer

    server = LiveServer(int4_target)
    try:
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
    finally:
        server.stop()
    assert card["target_weights"] == "int4"
    assert "not the float32 target" in card["note"]


def test_a_float32_target_is_labelled_float32_and_nothing_more(tmp_path):
    import httpx

    from helpers_server import LiveServer

    server = LiveServer(_build(tmp_path))
    try:
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
    finally:
        server.stop()
    assert card["target_weights"] == "float32" and "note" not in card


@pytest.mark.parametrize("blocks", [(), ("onnxruntime.target_block_size=128",
                                           "onnxruntime.draft_weights=int4",
                                           "onnxruntime.draft_block_size=64")],
                         ids=["blocks-of-32", "blocks-of-128"])
def test_bench_numerics_measures_an_int4_target_against_fp32(tmp_path, blocks):
    """Also for a recipe with block sizes: its float32 column drops them with the format."""
    from qpcbuild.cli import app

    js = tmp_path / "n.json"
    sets = [a for b in blocks for a in ("--set", b)]
    res = CliRunner().invoke(app, [
        "bench", str(DEMO_RECIPE), "--numerics", "--set", "onnxruntime.target_weights=int4",
        *sets, "--num-prompts", "2", "--max-new-tokens", "24", "--ks", "4",
        "--cache-dir", str(tmp_path / "cache"), "--bundle-dir", str(tmp_path / "b"),
        "--json-out", str(js), "--no-plot"])
    assert res.exit_code == 0, res.output
    fp, low = json.loads(js.read_text())["columns"]
    assert (fp["target_weights"], low["target_weights"]) == ("float32", "int4")
    assert fp["numerics"] == low["numerics"] == "exact"  # no card formats involved
    drift = low["logit_drift"]
    assert drift["max"] > 0 and 0 < drift["teacher_forced_top1_agreement"] <= 1
    assert len(low["greedy_agreement"]["first_divergence"]) == 2
    assert "ORT target weights int4 blocks" in res.output


def _window_drift(bundle: Path, window: int, floor: int | None = None,
                  step: int | None = None) -> float:
    """Max |logit difference| between each output token's target logits computed one token a
    call (target-only decode, padded to the session's window floor unless `floor` replaces
    it) and `window` tokens a call (a verify window); `step` replaces the session's window
    step for both."""
    import qpcbuild
    from qpcbuild.numerics_bench import teacher_forced_logits

    gen = qpcbuild.load(bundle, verify="none")
    padded, worst = gen.target.min_window, 0.0
    if step is not None:
        gen.target.window_step = step
    for prompt in ("def add(a, b):", "The capital of France is", "for i in range(10):"):
        ids = gen.encode(prompt)
        out = gen.generate([ids], max_new_tokens=24, target_only=True).rows[0].tokens[len(ids):]
        ref = teacher_forced_logits(gen, ids, out, window)
        if floor is not None:
            gen.target.min_window = floor
        one = teacher_forced_logits(gen, ids, out, 1)
        gen.target.min_window = padded
        worst = max(worst, float(np.abs(one - ref).max()))
    return worst


def test_an_int4_target_gives_a_token_the_same_logits_alone_or_in_a_verify_window(int4_target):
    """A target keeps int8 activations (accuracy_level 4, the fast kernel) and carries at
    least 2 tokens a call: a lone token through ORT's GroupQueryAttention takes MLAS's
    single-row kernel, whose last bits int8 activations round into visible logit changes
    (SmolLM2: up to 2.5, greedy tokens flipped; docs/weight-formats.md). Padded to 2, a token's
    logits are bitwise those it gets inside a verify window of 5."""
    levels = {role: {a.i for n in onnx_nodes(int4_target, role) for a in n.attribute
                     if a.name == "accuracy_level"} for role in ("target", "draft")}
    assert levels == {"target": {4}, "draft": {4}}
    assert _window_drift(int4_target, 5) == 0.0
    # the same bundle driven one token a call: the logits move with the window
    assert _window_drift(int4_target, 5, floor=1) > 1e-2


def test_block_sizes_reach_the_graphs_the_keys_and_the_manifest(tmp_path):
    """onnxruntime.<role>_block_size: each role's MatMulNBits nodes take that block, the
    manifest records it, the cache keys tell it apart, and speculation stays lossless relative
    to that target; a draft left at 32 keeps the key it had."""
    import qpcbuild
    from qpcbuild.plan import make_plan
    from qpcbuild.recipe import load_recipe

    sets = ("onnxruntime.draft_weights=int4", "onnxruntime.target_weights=int4")
    wide = sets + ("onnxruntime.target_block_size=128", "onnxruntime.draft_block_size=64")
    out = _build(tmp_path, *wide)
    for role, block in (("target", 128), ("draft", 64)):
        assert {a.i for n in onnx_nodes(out, role) for a in n.attribute
                if a.name == "block_size"} == {block}
    roles = json.loads((out / "manifest.json").read_text())["roles"]
    assert roles["target"]["backends"]["onnxruntime"]["block_size"] == 128
    assert roles["draft"]["backends"]["onnxruntime"]["block_size"] == 64
    # the target's integer kernel pairs rows in such blocks: its windows are padded to even
    assert roles["target"]["backends"]["onnxruntime"]["window_step"] == 2
    assert "window_step" not in roles["draft"]["backends"]["onnxruntime"]

    def keys(*overrides):
        plan = make_plan(load_recipe(DEMO_RECIPE, list(overrides)))
        return {rp.role: rp.cache_keys.backends["onnxruntime"] for rp in plan.roles}

    default, blocks = keys(*sets), keys(*wide)
    assert default["target"] != blocks["target"] and default["draft"] != blocks["draft"]
    assert keys(*sets, "onnxruntime.target_block_size=128")["draft"] == default["draft"]
    default_manifest = json.loads((_build(tmp_path / "b32", *sets) / "manifest.json")
                                  .read_text())["roles"]
    assert "block_size" not in default_manifest["target"]["backends"]["onnxruntime"]
    gen = qpcbuild.load(out, verify="none")
    for prompt in ("def add(a, b):", "The capital of", "for i in range("):
        spd = gen.generate([prompt], max_new_tokens=32).rows[0].tokens
        assert spd == gen.generate([prompt], max_new_tokens=32, target_only=True).rows[0].tokens
    assert _window_drift(out, 5) == 0.0  # 5 runs as 6, 1 as 2
    assert _window_drift(out, 5, step=1) > 0.0  # odd windows as they are: the last row drifts


def test_only_a_quantized_target_pads_its_lone_tokens(int4_target, tmp_path):
    """The window floor is the int8/int4 target's: its draft, and a float32 target (whose
    manifest stays as it was), run lone tokens as they are."""
    import qpcbuild

    roles = json.loads((int4_target / "manifest.json").read_text())["roles"]
    assert roles["target"]["backends"]["onnxruntime"]["min_window"] == 2
    assert "min_window" not in roles["draft"]["backends"]["onnxruntime"]
    gen = qpcbuild.load(int4_target, verify="none")
    assert (gen.target.min_window, gen.draft.min_window) == (2, 1)
    fp32 = _build(tmp_path)
    assert "min_window" not in json.loads((fp32 / "manifest.json").read_text())[
        "roles"]["target"]["backends"]["onnxruntime"]
    assert qpcbuild.load(fp32, verify="none").target.min_window == 1


def test_a_window_floor_binds_one_padded_window_per_batch_size():
    """A session with a floor of 2 adds a 2-token window beside each batch size's narrower
    ones, keeping their logits rows (1 for a lone token: the LM head skips the padding), and
    none where a 2-token window is compiled already (a K=1 verify)."""
    from qpcbuild.runtime.model_session import Specialization, padded_windows

    def spec(batch, seq, logits):
        return Specialization(f"S{batch}x{seq}", batch, seq, 64, logits)

    decode = [spec(1, 32, 1), spec(1, 1, 1), spec(1, 5, 5), spec(4, 1, 1)]
    assert [(s.batch_size, s.seq_len, s.num_logits) for s in padded_windows(decode, 2)] == \
        [(1, 2, 1), (4, 2, 1)]
    assert padded_windows(decode + [spec(1, 2, 2)], 2) == [Specialization("Window_2", 4, 2, 64, 1)]
    assert padded_windows(decode, 1) == []
    # a step of 2 also widens each odd window by one, and its logits rows (the LM head's call)
    assert [(s.batch_size, s.seq_len, s.num_logits) for s in padded_windows(decode, 2, 2)] == \
        [(1, 2, 2), (1, 6, 6), (4, 2, 2)]
    assert padded_windows(decode + [spec(1, 6, 6)], 2, 2) == [
        Specialization("Window_2", 1, 2, 64, 2), Specialization("Window_2", 4, 2, 64, 2)]


def test_an_int4_target_pads_its_last_tokens_inside_the_buffer(tmp_path):
    """At the end of the KV buffer a padded lone token has no slot after it: the engine
    shifts the window left over tokens already verified (recomputing identical KV), so
    target-only and speculation both run to ctx_len and still agree token for token."""
    import qpcbuild

    gen = qpcbuild.load(_build(tmp_path, "onnxruntime.draft_weights=int4",
                               "onnxruntime.target_weights=int4", "shapes.ctx_len=64"),
                        verify="none")
    for prompt in ("def add(a, b):", "The capital of France is"):
        alone = gen.generate([prompt], max_new_tokens=200, target_only=True).rows[0]
        spd = gen.generate([prompt], max_new_tokens=200).rows[0]
        assert (len(alone.tokens), alone.finish_reason) == (64, "ctx_len")
        assert spd.tokens == alone.tokens and spd.finish_reason == "ctx_len"


def onnx_nodes(bundle: Path, role: str) -> list:
    import onnx

    graph = onnx.load(str(bundle / role / "ort" / "model.onnx"), load_external_data=False).graph
    return [n for n in graph.node if n.op_type == "MatMulNBits"]

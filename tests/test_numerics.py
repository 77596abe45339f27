"""The numerics preview: OCP MX formats (MXFP6 E2M3 weights, MXINT8 KV) emulated on the CPU.

Oracles: hand-worked values from the OCP MX v1.0 rules, the exhaustive FP6 E2M3 grid, torchao's
independent MX implementation (bit for bit, when installed), and our numpy quantizer for the
in-graph ONNX MXINT8 quantize-dequantize; on bundles, the stored weights and the KV cache
themselves.
"""

from __future__ import annotations

import io
import json
import types
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from qpcbuild import numerics as nx
from qpcbuild.errors import RecipeError
from qpcbuild.numerics import FP6_E2M3, INT8

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
runner = CliRunner()


def block(*values: float) -> np.ndarray:
    out = np.zeros(32, np.float32)
    out[:len(values)] = values
    return out


# ---------------------------------------------------------------- the formats by hand
def test_fp6_e2m3_grid_is_the_spec_grid_exhaustively():
    mags = sorted({abs(v) for v in nx.fp6_e2m3_grid()})
    expect = [m / 8 for m in range(16)] + [2 + m / 4 for m in range(8)] + \
        [4 + m / 2 for m in range(8)]
    assert mags == expect and max(mags) == 7.5 and len(mags) == 32
    codes = np.arange(64)
    values = nx.fp6_e2m3_decode(codes)
    # every code round-trips, the sign bit included (-0 is code 0x20)
    assert np.array_equal(nx.fp6_e2m3_encode(values, negative=codes >= 32), codes)
    # rounding any value of the grid (at any scale) returns it: the grid is closed
    for e in (-3, 0, 5):
        x = np.zeros((2, 32))
        x[0] = values[:32] * 2.0 ** e
        x[1] = values[32:] * 2.0 ** e
        x[:, 0] = 7.5 * 2.0 ** e  # the block max fixes the scale at 2^e
        assert np.array_equal(nx.mx_round(x, FP6_E2M3), x.astype(np.float32))


@pytest.mark.parametrize("values, scale_code, expect", [
    # max 1.0: e = floor(log2 1) - 2 = -2, X = 1/4, P = 4 (exponent field 3)
    ((1.0, -1.0, 0.3), 125, (1.0, -1.0, 0.3125)),  # 0.3/X = 1.2 -> 1.25
    # max 7.5: X = 1; 0.3 lies between 0.25 and 0.375 -> 0.25 (nearest)
    ((7.5, 0.3), 127, (7.5, 0.25)),
    # ties go to the even mantissa: 4.25 -> 4, 4.75 -> 5, 0.0625 -> 0, 0.1875 -> 0.25, 2.125 -> 2
    ((7.0, 4.25, 4.75, 0.0625, 0.1875, 2.125), 127, (7.0, 4.0, 5.0, 0.0, 0.25, 2.0)),
    # max 7.9 (same scale as 4..8): saturates to 7.5, no Inf code exists
    ((7.9, 1.0), 127, (7.5, 1.0)),
    # max 3.999: floor(log2) = 1, X = 1/2, P = 7.998 saturates to 7.5 -> 3.75
    ((3.999, 0.01), 126, (3.75, 0.0)),
    # subnormal elements: max 6.0 -> X = 1; 0.6 -> 0.625 (5/8), 0.05 -> 0.0, -0.1 -> -0.125
    ((6.0, 0.6, 0.05, -0.1), 127, (6.0, 0.625, 0.0, -0.125)),
    # a large scale: max 2999 -> floor(log2) = 11, X = 2^9; 2999/512 = 5.857 -> 6 -> 3072;
    # 100/512 = 0.195 is nearer 0.25 than 0.125 -> 128
    ((2999.0, 100.0), 136, (3072.0, 128.0)),
])
def test_mxfp6_hand_worked_values(values, scale_code, expect):
    x = block(*values)
    codes, _ = nx.quantize(x, FP6_E2M3)
    assert codes[0] == scale_code
    assert tuple(nx.mx_round(x, FP6_E2M3)[:len(values)].tolist()) == expect


def test_mxint8_hand_worked_values():
    # max 1.0: e = floor(log2 1) - 0 = 0, elements k/64
    x = block(1.0, 0.3, 2.5 / 64, 3.5 / 64, -1.0)
    codes, _ = nx.quantize(x, INT8)
    assert codes[0] == 127
    got = nx.mx_round(x, INT8)[:5]
    # 0.3*64 = 19.2 -> 19; ties to even: 2.5 -> 2, 3.5 -> 4
    assert got.tolist() == [1.0, 19 / 64, 2 / 64, 4 / 64, -1.0]
    # max 1.999: X = 1, 127.94 rounds to 128 and saturates to 127 (symmetric range; -128 unused)
    assert nx.mx_round(block(1.999, -1.999), INT8)[:2].tolist() == [127 / 64, -127 / 64]
    # max 48 -> X = 32: 48/32 = 1.5 -> 96/64; 0.2 -> 0.4 of a step -> 0
    assert nx.mx_round(block(48.0, 0.2), INT8)[:2].tolist() == [48.0, 0.0]
    # partial block (length 40): its own scale for the last 8 elements
    v = np.concatenate([np.full(32, 100.0), np.full(8, 0.01)]).astype(np.float32)
    assert np.allclose(nx.mx_round(v, INT8)[32:], 0.01, rtol=1 / 64)


@pytest.mark.parametrize("fmt", [FP6_E2M3, INT8])
def test_zero_nan_and_inf_policy(fmt):
    codes, elems = nx.quantize(np.zeros(32, np.float32), fmt)
    assert codes.tolist() == [0] and not elems.any()  # e = -127 (E8M0 code 0), elements 0
    for bad in (np.nan, np.inf, -np.inf):
        x = np.stack([block(1.0, bad), block(1.0, 0.5)])
        codes, _ = nx.quantize(x, fmt)
        out = nx.mx_round(x, fmt)
        assert codes[:, 0].tolist() == [nx.E8M0_NAN, 127 - nx.EMAX[fmt]]
        assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()  # only that block is NaN


def test_mxfp6_error_is_bounded_by_the_format():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((96, 40)) * np.exp(rng.uniform(-6, 6, (1, 40)))).astype(np.float32)
    q = nx.mxfp6_weight(w)
    codes, _ = nx.quantize(w, FP6_E2M3, axis=0)  # [N, 3 blocks]
    x = np.repeat(np.ldexp(1.0, codes.astype(int) - 127), 32, axis=1).T  # X per element
    err = np.abs(q.astype(np.float64) - w)
    # below 4X the grid step is at most X/4 (error <= X/8); above, X/2 (error <= X/4), and
    # saturation from [7.5X, 8X) costs < X/2
    assert (err[np.abs(w) < 4 * x] <= x[np.abs(w) < 4 * x] / 8).all()
    assert (err < x / 2).all() and (err > 0).any()


# ---------------------------------------------------------------- torchao as the oracle
def _torchao():
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3
    return torch, mx.to_mx, ScaleCalculationMode.FLOOR, DTYPE_FP6_E2M3


def oracle_blocks() -> np.ndarray:
    """Random and adversarial blocks [n, 32], float32."""
    rng = np.random.default_rng(7)
    rows = [rng.standard_normal((200, 32)) * np.exp(rng.uniform(-20, 20, (200, 1)))]
    # ties: exact grid midpoints at a fixed scale (max 7 -> X = 1)
    mids = (nx.fp6_e2m3_grid()[33:] + nx.fp6_e2m3_grid()[32:-1]) / 2
    t = np.zeros((1, 32))
    t[0, :len(mids[:31])] = mids[:31]
    t[0, 31] = 7.0
    rows += [t, -t]
    # maxima at and just below powers of two; saturating values; negative zeros; subnormal
    # elements next to a normal max
    for p in (-10, 0, 1, 2, 3, 30):
        b = rng.standard_normal((3, 32)) * 2.0 ** (p - 3)
        b[0, 0] = 2.0 ** p
        b[1, 0] = np.nextafter(np.float32(2.0 ** p), np.float32(0))
        b[2, 0] = 2.0 ** p * 1.99
        rows.append(b)
    z = np.zeros((1, 32))
    z[0, :4] = [5.0, -0.0, -1e-3, 1e-3]
    rows.append(z)
    rows.append(np.zeros((1, 32)))  # all zero
    return np.concatenate(rows).astype(np.float32)


def ours_vs_torchao(x: np.ndarray) -> int:
    """Mismatching blocks (scale code or any element code) between our quantizer and torchao's
    to_mx(E2M3, block 32, FLOOR: the OCP rule)."""
    torch, to_mx, floor, e2m3 = _torchao()
    scale, data = to_mx(torch.from_numpy(x), e2m3, 32, floor)
    their_scale = scale.view(torch.uint8).numpy().reshape(-1)
    their_codes = data.numpy().reshape(-1, 32)
    codes, elems = nx.quantize(x, FP6_E2M3)
    our_codes = nx.fp6_e2m3_encode(elems.reshape(-1, 32), negative=np.signbit(x))
    # torchao divides by 2^-126 where the scale code is 0 (2^-127; see numerics' docstring),
    # so it is compared where both agree on code 0 and every element is zero
    low = codes.reshape(-1) == 0
    bad = (their_scale != codes.reshape(-1)) | (~low & (their_codes != our_codes).any(axis=1))
    bad |= low & ((their_codes & 0x1F).any(axis=1) | (our_codes & 0x1F).any(axis=1))
    return int(bad.sum())


def test_mxfp6_matches_torchao_bit_for_bit():
    x = oracle_blocks()
    assert ours_vs_torchao(x) == 0
    assert ours_vs_torchao(x.reshape(-1)[::-1].copy().reshape(-1, 32)) == 0


def _half_up(p, fmt):
    step = np.ldexp(1.0, np.clip(nx._floor_log2(np.where(np.abs(p) > 0, np.abs(p), 1.0)), 0,
                                 2) - 3)
    return np.clip(np.floor(p / step + 0.5) * step, -7.5, 7.5)


def _truncate(p, fmt):
    step = np.ldexp(1.0, np.clip(nx._floor_log2(np.where(np.abs(p) > 0, np.abs(p), 1.0)), 0,
                                 2) - 3)
    return np.clip(np.trunc(p / step) * step, -7.5, 7.5)


@pytest.mark.parametrize("broken", ["round-half-up", "truncation", "scale-exponent+1",
                                    "no-saturation-clip-at-7"])
def test_a_broken_quantizer_is_caught_by_the_oracle(monkeypatch, broken):
    x = oracle_blocks()
    real_round = nx.round_elements
    if broken == "round-half-up":
        monkeypatch.setattr(nx, "round_elements", _half_up)
    elif broken == "truncation":
        monkeypatch.setattr(nx, "round_elements", _truncate)
    elif broken == "scale-exponent+1":
        monkeypatch.setitem(nx.EMAX, FP6_E2M3, 1)
    else:  # saturating at 7 instead of 7.5
        monkeypatch.setattr(nx, "round_elements",
                            lambda p, fmt: np.clip(real_round(p, fmt), -7.0, 7.0))
    assert ours_vs_torchao(x) > 0


# ---------------------------------------------------------------- the in-graph MXINT8
def _qdq_graph(heads: int, d: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from qpcbuild.backends.onnxruntime.ort_graph import _Lowered
    from qpcbuild.export.builder import GraphBuilder

    g = GraphBuilder(io.BytesIO(), "unused.data")
    x = g.input("x", TensorProto.FLOAT, ["b", "s", heads * d])
    low = _Lowered(g, types.SimpleNamespace(head_dim=d), None, 1, 32, mxint8=True)
    g.nodes.append(helper.make_node("Identity", [low.mxint8_qdq(x, heads)], ["y"]))
    g.output("y", TensorProto.FLOAT, ["b", "s", heads * d])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    model = g.model("qdq", 17, {})
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("heads, d", [(3, 64), (2, 32), (2, 48)])  # 48: a short last block
def test_onnx_mxint8_qdq_equals_the_numpy_quantizer(heads, d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((2, 40, heads * d)) * np.exp(rng.uniform(-12, 12, (2, 40, 1)))
    v = x.reshape(2, 40, heads, d)
    # adversarial rows: maxima at and just below powers of two, exact ties, zeros, saturation,
    # NaN and infinity
    v[0, 0, 0, 0] = 4.0
    v[0, 1, 0, 0] = np.nextafter(np.float32(4.0), np.float32(0))
    v[0, 2, 0, :8] = [1.0, 2.5 / 64, 3.5 / 64, -5.5 / 64, 0.5 / 64, -0.5 / 64, 1.5 / 64, 0]
    v[0, 3] = 0.0
    v[0, 4, 0, :2] = [1.999, -1.999]
    v[0, 5, 0, 1] = np.nan
    v[0, 6, 0, 2] = np.inf
    v[0, 7, 0, 3] = -np.inf
    x = v.reshape(2, 40, heads * d).astype(np.float32)
    got = _qdq_graph(heads, d).run(None, {"x": x})[0]
    want = nx.mx_round(x.reshape(2, 40, heads, d), INT8, axis=-1).reshape(x.shape)
    np.testing.assert_array_equal(got, want)  # bit for bit; NaN where numpy has NaN
    # only the block holding the NaN (head 0, elements 0..31) is NaN
    assert np.isnan(got[0, 5, :32]).all() and np.isfinite(got[0, 5, 32:]).all()


# ---------------------------------------------------------------- recipes and plans
def _load(*overrides):
    from qpcbuild.recipe import load_recipe
    return load_recipe(ROOT / "recipes" / "demo.yaml", list(overrides))


def test_recipe_accepts_card_formats_on_onnxruntime_and_refuses_them_on_a_portable_graph():
    r = _load("precision.quantization=mxfp6", "precision.kv_cache_dtype=mxint8")
    assert r.backends == ["onnxruntime"]
    with pytest.raises(RecipeError) as info:
        _load("precision.quantization=mxfp6", "precision.kv_cache_dtype=mxint8",
              "onnxruntime.graph=portable")
    paths = {p.path for p in info.value.problems}
    assert paths == {"precision.quantization", "precision.kv_cache_dtype"}, paths
    assert all("graph is portable" in p.message and "fused graph only" in p.message
               for p in info.value.problems)
    # the fused graph runs once per row, so a batch or continuous batching emulates them too
    for extra in ("shapes.batch_size=2", "shapes.full_batch_size=2"):
        _load("precision.quantization=mxfp6", "precision.kv_cache_dtype=mxint8", extra)
    # the CLI: exit code 2
    res = runner.invoke(__import__("qpcbuild.cli", fromlist=["app"]).app, [
        "plan", str(ROOT / "recipes" / "demo.yaml"), "--set", "precision.kv_cache_dtype=mxint8",
        "--set", "onnxruntime.graph=portable"])
    assert res.exit_code == 2 and "precision.kv_cache_dtype" in res.output
    # next to qaic a portable graph is fine (the card does the real thing; ORT stays exact)
    _load("precision.quantization=mxfp6", "shapes.batch_size=2", "backends=[onnxruntime, qaic]")


def test_plan_numerics_cache_keys_and_unchanged_qaic_argv():
    from qpcbuild.plan import make_plan

    exact = make_plan(_load()).role("target")
    emu = make_plan(_load("precision.quantization=mxfp6")).role("target")
    both = make_plan(_load("precision.quantization=mxfp6", "precision.kv_cache_dtype=mxint8"))
    ort_exact, ort_emu = exact.backends["onnxruntime"], emu.backends["onnxruntime"]
    assert ort_exact.numerics == "exact" and ort_emu.numerics == "emulated"
    assert ort_emu.numerics_formats == {"weights": "mxfp6-e2m3-block32", "kv": "float32"}
    keys = {exact.cache_keys.backends["onnxruntime"], emu.cache_keys.backends["onnxruntime"],
            both.role("target").cache_keys.backends["onnxruntime"]}
    assert len(keys) == 3  # the numerics are in the ORT artifact's key
    assert emu.cache_keys.export == exact.cache_keys.export  # the export is shared
    card = make_plan(_load("precision.quantization=mxfp6", "backends=[qaic]"))
    pair = make_plan(_load("precision.quantization=mxfp6", "backends=[onnxruntime, qaic]"))
    for role in ("target", "draft"):
        argv = pair.role(role).backends["qaic"].compiler_argv
        assert argv == card.role(role).backends["qaic"].compiler_argv
        assert "-mxfp6-matmul" in argv
        assert pair.role(role).cache_keys.backends["qaic"] == card.role(role).cache_keys.backends["qaic"]
        assert pair.role(role).backends["onnxruntime"].numerics == "emulated"


# ---------------------------------------------------------------- bundles


def _build(tmp_factory, name: str, *overrides: str) -> Path:
    from qpcbuild.bundle import build_bundle
    from qpcbuild.cache import Cache
    from qpcbuild.plan import make_plan

    out = tmp_factory.mktemp(name) / "bundle"
    build_bundle(make_plan(_load(*overrides)), cache=Cache(tmp_factory.getbasetemp() / "cache"),
                 out=out)
    return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    return {"fp32": _build(tmp_path_factory, "fp32"),
            "emu": _build(tmp_path_factory, "emu", "precision.quantization=mxfp6",
                          "precision.kv_cache_dtype=mxint8"),
            "kv": _build(tmp_path_factory, "kv", "precision.kv_cache_dtype=mxint8"),
            "w": _build(tmp_path_factory, "w", "precision.quantization=mxfp6")}


def _initializers(bundle: Path, role: str = "target") -> tuple[dict, dict]:
    """(name -> array, name -> op types consuming it) of a role's ORT artifact."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(bundle / role / "ort" / "model.onnx"))
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    users: dict[str, set] = {}
    for n in model.graph.node:
        for i in n.input:
            users.setdefault(i, set()).add(n.op_type)
    return arrays, users


def test_emulated_bundle_weights_lie_on_the_mxfp6_grid(bundles):
    for role in ("target", "draft"):
        arrays, users = _initializers(bundles["emu"], role)
        exact, _ = _initializers(bundles["fp32"], role)
        mats = [n for n in arrays if "MatMul" in users.get(n, ()) and arrays[n].ndim == 2
                and arrays[n].shape[0] > 32]
        layers = json.loads((bundles["emu"] / "manifest.json").read_text())["roles"][role][
            "arch"]["num_layers"]
        assert len(mats) == 4 * layers + 1, mats  # qkv, o, gate_up, down per layer + lm_head
        for n in mats:
            w = arrays[n]
            assert w.dtype == np.float32
            assert np.array_equal(nx.mxfp6_weight(w), w), n  # every block is its own rounding
            assert np.array_equal(nx.mxfp6_weight(exact[n]), w), n  # ... of the exact weight
            assert not np.array_equal(nx.mxfp6_weight(exact[n]), exact[n]), n  # (can fail)
        gathers = [n for n in arrays if "Gather" in users.get(n, ()) and arrays[n].ndim == 2
                   and max(arrays[n].shape) > 1000]
        assert gathers, "embedding table"
        for n in gathers:  # the embedding gather is not a matmul: stays exact
            assert np.array_equal(arrays[n], exact[n]), n


def _prefill(bundle: Path, ids: list[int]):
    import qpcbuild

    gen = qpcbuild.load(bundle, verify="none")
    t = gen.target
    t.run(np.array([ids[:32]]), np.arange(32)[None])
    logits = t.run(np.array([ids[32:37]]), np.arange(32, 37)[None]).copy()  # a K=4 window
    kv = [b.copy() for b in t.kv_buffers[0]]
    return gen, logits, kv


@pytest.fixture(scope="module")
def prompt_ids(bundles):
    import qpcbuild

    text = json.loads((DEMO / "eval_prompts.jsonl").read_text().splitlines()[0])["text"]
    return qpcbuild.load(bundles["fp32"], verify="none").encode(text)[:37]


def test_kv_cache_holds_mxint8_values_of_the_post_rope_keys(bundles, prompt_ids):
    _, _, exact = _prefill(bundles["fp32"], prompt_ids)
    _, _, emu = _prefill(bundles["kv"], prompt_ids)
    n = len(prompt_ids)
    for j in (0, 1):  # layer 0: K (post-RoPE in the cache) and V; same inputs, exact weights
        a, b = exact[j][0, :, :n], emu[j][0, :, :n]  # [heads, slots, D]
        assert np.array_equal(nx.mx_round(b, INT8), b)  # on the MXINT8 grid, as stored
        codes, _ = nx.quantize(a, INT8)
        half_step = np.repeat(np.ldexp(1.0, codes.astype(int) - 127), 32, -1) / 128
        assert (np.abs(b - a) <= half_step * (1 + 1e-5) + 1e-7).all()  # the format's bound
        assert np.abs(b - a).max() > 0  # the emulation is applied
        # and it is the quantization of the post-RoPE key the card stores (pre-RoPE QDQ, then
        # rotating, would leave the grid)
        np.testing.assert_allclose(b, nx.mx_round(a, INT8), atol=float(half_step.max()) * 2.01)
        assert np.mean(b == nx.mx_round(a, INT8)) > 0.99
    # slots never written stay zero
    assert not emu[0][0, :, n + 1:].any()


def test_emulated_logits_differ_from_fp32_but_stay_close(bundles, prompt_ids):
    _, exact, _ = _prefill(bundles["fp32"], prompt_ids)
    gen, emu, _ = _prefill(bundles["emu"], prompt_ids)
    drift = np.abs(emu - exact)
    assert drift.max() > 1e-3  # the emulation is applied
    assert drift.max() < 0.2 * np.abs(exact).max()
    info = gen.manifest.to_json_dict()["roles"]["target"]["backends"]["onnxruntime"]
    assert info["numerics"] == "emulated" and info["weights"] == "float32"
    assert info["numerics_formats"] == {"weights": "mxfp6-e2m3-block32", "kv": "mxint8-block32"}
    fp = json.loads((bundles["fp32"] / "manifest.json").read_text())
    assert fp["roles"]["draft"]["backends"]["onnxruntime"]["numerics"] == "exact"


@pytest.mark.slow
def test_emulated_weights_give_the_logits_of_transformers_with_torchao_mx_weights(bundles,
                                                                                  prompt_ids):
    """End to end against an independent stack: the demo target in transformers with every
    nn.Linear weight (and the tied lm_head, untied; the embedding stays exact) rounded by
    torchao's MXFP6 (blocks of 32 along in_features, FLOOR scales), over the same tokens."""
    import qpcbuild
    from qpcbuild.numerics_bench import teacher_forced_logits

    torch, to_mx, floor, e2m3 = _torchao()
    transformers = pytest.importorskip("transformers")
    from torchao.prototype.mx_formats.mx_tensor import to_dtype

    def mx(w):  # torchao wants whole blocks: pad with zeros (down_proj has 688 = 21.5 x 32)
        n = w.shape[-1]
        padded = torch.nn.functional.pad(w, (0, -n % 32)).contiguous()
        scale, data = to_mx(padded, e2m3, 32, floor)
        return to_dtype(data, scale, e2m3, 32, torch.float32)[..., :n]

    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO / "target"),
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        exact = model(torch.tensor([prompt_ids])).logits[0, 31:36].numpy()
        model.lm_head.weight = torch.nn.Parameter(mx(model.model.embed_tokens.weight.clone()))
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                m.weight.copy_(mx(m.weight))
        want = model(torch.tensor([prompt_ids])).logits[0, 31:36].numpy()
    gen = qpcbuild.load(bundles["w"], verify="none")
    got = teacher_forced_logits(gen, prompt_ids[:32], prompt_ids[32:], 5)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
    assert np.abs(exact - want).max() > 20 * 2e-3  # the rounding is visible at this tolerance


def test_int8_draft_weights_hold_the_mxfp6_values_exactly(tmp_path_factory, bundles):
    out = _build(tmp_path_factory, "int8mx", "precision.quantization=mxfp6",
                 "onnxruntime.draft_weights=int8")
    m = json.loads((out / "manifest.json").read_text())
    d = m["roles"]["draft"]["backends"]["onnxruntime"]
    assert d["weights"] == "int8" and d["numerics_formats"]["weights"] == "mxfp6-e2m3-block32"
    arrays, _ = _initializers(out, "draft")
    exact, _ = _initializers(bundles["fp32"], "draft")
    name = next(n for n in exact if n.endswith("down_proj.weight^T"))
    w = exact[name]
    q, s = arrays[f"{name}.q8"], arrays[f"{name}.scale"]
    k, n_out = w.shape
    deq = ((q.astype(np.float64) - 128) * s.reshape(n_out, -1, 1)).reshape(n_out, -1)[:, :k].T
    assert np.array_equal(deq.astype(np.float32), nx.mxfp6_weight(w))


def test_run_prints_the_numerics(bundles):
    from qpcbuild.cli import app

    res = runner.invoke(app, ["run", str(bundles["emu"]), "--prompt", "def f(",
                              "--max-new-tokens", "4", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["numerics"]["target"] == {"numerics": "emulated", "weights": "mxfp6-e2m3-block32",
                                         "kv": "mxint8-block32", "matmul_weights": "float32"}


@pytest.mark.slow
def test_bench_numerics_reports_fp32_and_emulated_side_by_side(tmp_path):
    from qpcbuild.cli import app

    js = tmp_path / "n.json"
    res = runner.invoke(app, ["bench", str(ROOT / "recipes" / "demo.yaml"), "--numerics",
                              "--num-prompts", "2", "--max-new-tokens", "24", "--ks", "4",
                              "--cache-dir", str(tmp_path / "cache"), "--bundle-dir",
                              str(tmp_path / "b"), "--json-out", str(js)])
    assert res.exit_code == 0, res.output
    rep = json.loads(js.read_text())
    cols = rep["columns"]
    assert [c["numerics"] for c in cols] == ["exact", "emulated"]
    for c in cols:
        assert len(c["acceptance_per_position"]) == 4 and c["tau"] >= 1
    emu = cols[1]
    assert emu["formats"] == {"weights": "mxfp6-e2m3-block32", "kv": "mxint8-block32"}
    assert emu["logit_drift"]["max"] > 0 and emu["logit_drift"]["mean"] > 0
    assert len(emu["greedy_agreement"]["first_divergence"]) == 2
    assert (tmp_path / "n.png").is_file()
    assert "emulated" in res.output

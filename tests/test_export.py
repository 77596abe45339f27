"""Tests for qpcbuild.export: the exported retained-state decoder graph computes what transformers
computes, speaks the Cloud AI I/O contract, is deterministic, and refuses bad checkpoints cleanly.

Reference for the contract: docs/graph.md (interface, dialect, invalid indices).
"""

from __future__ import annotations

import errno
import inspect
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
import onnxruntime as ort
import pytest
import torch

import qpcbuild
from qpcbuild.errors import QpcbuildError, UsageError
from qpcbuild.export import DATA_FILE, GRAPH_FILE, ExportResult, export_model
from qpcbuild.bundle.doctor import check_model
from qpcbuild.export.builder import GraphBuilder
from qpcbuild.models.source import resolve, safetensors_files

from helpers_export import GraphDriver, hf_logits, prefill, run_mixed_batch

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
TOL = 1e-4
# built by the `tiny_models` fixture (tests/conftest.py)
TINY_FAMILY_VARIANTS = ("llama", "llama_untied_rope", "llama_bf16", "mistral", "qwen2", "qwen3",
                        "mistral_sliding", "gemma3", "gemma2", "gemma3_bf16", "granite",
                        "phi3", "qwen3_moe", "mixtral", "gpt_oss")


# ------------------------------------------------------------------ helpers
# (running a graph and transformers' logits: tests/helpers_export.py)


@pytest.fixture(scope="session")
def exported(tiny_models, tmp_path_factory):
    """export(variant, role, continuous_batching=False, weight_dtype="float32"), cached."""
    root = tmp_path_factory.mktemp("exports")
    cache: dict[tuple, ExportResult] = {}

    def get(variant: str, role: str, cb: bool = False, dtype: str = "float32") -> ExportResult:
        key = (variant, role, cb, dtype)
        if key not in cache:
            out = root / "-".join([variant, role, "cb" if cb else "plain", dtype])
            cache[key] = export_model(resolve(str(tiny_models[variant])), role, out,
                                      continuous_batching=cb, weight_dtype=dtype)
        return cache[key]

    return get


def assert_close(actual: np.ndarray, expected: np.ndarray, tol: float = TOL, what: str = ""):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    diff = float(np.max(np.abs(actual - expected)))
    assert diff <= tol, f"{what}: max abs logit difference {diff:.3g} > {tol}"


# ------------------------------------------------------------- 1. fidelity against transformers


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("variant", TINY_FAMILY_VARIANTS)
def test_logits_match_transformers_for_prefill_padding_decode_and_verify(
        variant, role, tiny_models, exported):
    path, k, lengths = tiny_models[variant], 3, [14, 10]
    result = exported(variant, role)
    vocab = result.arch.vocab_size
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab, (2, max(lengths) + k + 2))
    ref = [hf_logits(path, tokens[r, :n + k + 2]) for r, n in enumerate(lengths)]

    steps = run_mixed_batch(GraphDriver(result.onnx_path, 2, ctx_len=32), tokens, lengths, k)
    expect_rows = {"chunk1": [7, 7], "chunk2": [n - 1 for n in lengths], "decode": lengths}
    for step, rows in expect_rows.items():
        assert steps[step].shape == (2, 1, vocab)
        for r, row in enumerate(rows):
            assert_close(steps[step][r, 0], ref[r][row], what=f"{variant} {role} {step} row {r}")
    verify = steps["verify"]
    if role == "target":  # K+1 logits: one per window position
        assert verify.shape == (2, k + 1, vocab)
        for r, n in enumerate(lengths):
            assert_close(verify[r], ref[r][n + 1:n + 2 + k], what=f"{variant} verify row {r}")
    else:  # draft / plain: only the last real token
        assert verify.shape == (2, 1, vocab)
        for r, n in enumerate(lengths):
            assert_close(verify[r, 0], ref[r][n + 1 + k], what=f"{variant} draft window row {r}")


def test_llama3_rope_scaling_and_head_dim_are_read_from_saved_config(tiny_models):
    """The transformers-5 `rope_parameters` form reaches the exporter (else the fidelity test of
    this variant would not be testing scaled RoPE at all)."""
    from qpcbuild.models.arch import arch_from_config

    config = json.loads((tiny_models["llama_untied_rope"] / "config.json").read_text())
    arch = arch_from_config(config)
    assert arch.head_dim == 32 and arch.head_dim * arch.num_heads != arch.hidden_size
    assert arch.rope_scaling and arch.rope_scaling["rope_type"] == "llama3"
    assert not arch.tie_word_embeddings
    plain = arch_from_config({k: v for k, v in config.items()
                              if k not in ("rope_parameters", "rope_scaling")})
    assert plain.rope_scaling is None
    changed = ~np.isclose(arch.inv_freq(), plain.inv_freq())
    assert changed.any() and not changed.all()  # low frequencies scaled, high ones kept


def test_bf16_checkpoint_is_exported_as_its_exact_float32_upcast(tiny_models, exported):
    from onnx import numpy_helper
    from safetensors.torch import load_file

    shard = tiny_models["llama_bf16"] / "model.safetensors"
    config = json.loads((tiny_models["llama_bf16"] / "config.json").read_text())
    assert (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"
    header = json.loads(_safetensors_header(shard))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    result = exported("llama_bf16", "target")
    assert result.metadata["weight_dtype"] == "float32"
    graph = onnx.load(str(result.onnx_path))  # with external data
    weights = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    source = load_file(shard)
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], source[name].float().numpy(), name)


def _safetensors_header(path: Path) -> str:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw[8:8 + n].decode()


# ------------------------------------------------------------------ 2. verify == sequential decode


@pytest.mark.parametrize("stale_extra", [0, 3], ids=["same-slots", "longer-stale-window"])
@pytest.mark.parametrize("k", [1, 3, 7])
# gemma3, gpt_oss: windows (6) shorter than the prompt; gpt_oss: sinks and experts; phi3: longrope
@pytest.mark.parametrize("variant", ["llama", "gemma3", "gpt_oss", "phi3"])
def test_verify_window_equals_sequential_decode_even_over_stale_kv(variant, k, stale_extra,
                                                                  tiny_models, exported):
    """A K+1 verify call gives the logits of K+1 single-token calls, also when its slots (and
    slots beyond it) hold KV from an earlier, rejected window: stale KV is invisible."""
    onnx_path, ctx_len = exported(variant, "target").onnx_path, 64
    rng = np.random.default_rng(100 + k)
    prompt = rng.integers(0, 256, 13).tolist()
    p = len(prompt)
    window = rng.integers(0, 256, k + 1)
    stale = (np.concatenate([window, rng.integers(0, 256, stale_extra)])
             + rng.integers(1, 256, k + 1 + stale_extra)) % 256  # differs at every slot
    assert (stale[:k + 1] != window).all()

    fresh = GraphDriver(onnx_path, 1, ctx_len)
    prefill(fresh, prompt, chunk=8)
    sequential = np.stack([fresh([[t]], [[p + i]])[0, 0] for i, t in enumerate(window)])

    spec = GraphDriver(onnx_path, 1, ctx_len)
    prefill(spec, prompt, chunk=8)
    spec([stale], [np.arange(p, p + len(stale))], nlk=len(stale))  # the rejected window
    verify = spec([window], [np.arange(p, p + k + 1)], nlk=k + 1)[0]

    assert_close(verify, sequential, what=f"K={k} verify vs sequential")
    assert (verify.argmax(-1) == sequential.argmax(-1)).all()
    # KV of every real slot agrees with the fresh cache; only the stale tail differs.
    for name, buf in spec.kv.items():
        np.testing.assert_allclose(buf[:, :, :p + k + 1], fresh.kv[name][:, :, :p + k + 1],
                                   atol=1e-5, err_msg=name)
    # and the fresh cache verifying the same window agrees too
    fresh2 = GraphDriver(onnx_path, 1, ctx_len)
    prefill(fresh2, prompt, chunk=8)
    assert_close(fresh2([window], [np.arange(p, p + k + 1)], nlk=k + 1)[0], sequential,
                 what=f"K={k} fresh verify")


# ------------------------------------------------------------------ 3. the demo pair, end to end


def _stdlib_prompts() -> list[str]:
    import collections
    import json as json_mod
    import textwrap

    return [inspect.getsource(m)[:360] for m in (json_mod, textwrap, collections)]


@pytest.mark.slow
@pytest.mark.parametrize("role", ["target", "draft"])
def test_demo_greedy_generation_through_graph_matches_transformers(role, tmp_path):
    model_dir = DEMO / role
    from transformers import AutoModelForCausalLM, AutoTokenizer

    new_tokens, chunk = 64, 32
    result = export_model(resolve(str(model_dir)), role, tmp_path / "graph")
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    for text in _stdlib_prompts():
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                              dtype=torch.long), do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=eos[0] if eos else 0)
        expected = out[0, len(ids):].tolist()
        assert len(expected) == new_tokens
        ctx_len = -(-(len(ids) + new_tokens + 2) // chunk) * chunk
        drv = GraphDriver(result.onnx_path, 1, ctx_len)
        logits = prefill(drv, ids, chunk)
        got = []
        for step in range(new_tokens):
            row = logits[0, -1].copy()
            row[eos] = -np.inf  # min_new_tokens: transformers suppresses EOS the same way
            got.append(int(row.argmax()))
            if step + 1 < new_tokens:
                logits = drv([[got[-1]]], [[len(ids) + step]], nlk=1)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        assert got == expected, f"prompt {text[:30]!r}: diverged at new token {first_diff}"


# ------------------------------------------------------------------ 4. the graph contract


@pytest.mark.parametrize("cb", [False, True], ids=["plain", "continuous-batching"])
@pytest.mark.parametrize("variant", ["llama", "qwen3"])  # tied embeddings; per-head q/k norms
def test_card_graph_speaks_qefficients_dialect(variant, cb, exported):
    """QEfficient's vocabulary (shared facts in dialect.py): its functions with their domains,
    input order and attributes; RoPE gathered from tables (no Cos/Sin); the lm_head a MatMul
    weight of its own even for a tied model; and nothing the card has not seen from QEfficient."""
    result = exported(variant, "target", cb)
    model = onnx.load(str(result.onnx_path), load_external_data=False)
    arch = result.arch
    functions = {(f.domain, f.name): f for f in model.functions}
    kv = ("CtxScatterCB", "CtxGatherCB") if cb else ("CtxScatter", "CtxGather")
    assert set(functions) == {("com.qualcomm.cloud", kv[0]), ("com.qualcomm.cloud", kv[1]),
                              ("com.qti.aisw.onnx", "CustomRMSNorm")}
    inputs = {name: list(f.input) for (_, name), f in functions.items()}
    assert inputs["CustomRMSNorm"] == ["hidden_states", "weight"]
    assert list(functions[("com.qti.aisw.onnx", "CustomRMSNorm")].attribute) == ["epsilon"]
    assert inputs[kv[0]] == (["data", "batch_index", "position_ids", "updates"] if cb
                             else ["data", "position_ids", "updates"])
    assert inputs[kv[1]] == (["data", "batch_index", "ctx_indices", "comp_ctx_len"] if cb
                             else ["data", "ctx_indices", "comp_ctx_len"])
    nodes = model.graph.node
    calls = Counter(n.op_type for n in nodes if n.domain)
    norms = 2 * arch.num_layers + 1 + (2 * arch.num_layers if arch.qk_norm else 0)
    assert calls == {kv[0]: 2 * arch.num_layers, kv[1]: 2 * arch.num_layers,
                     "CustomRMSNorm": norms}
    for n in nodes:
        if n.op_type == "CustomRMSNorm":
            assert [a.name for a in n.attribute] == ["epsilon"]
            assert n.attribute[0].f == pytest.approx(arch.rms_norm_eps)
    # The scatter's output is the retained-state graph output itself.
    scatter_outs = {n.output[0] for n in nodes if n.op_type == kv[0]}
    assert scatter_outs == {o.name for o in model.graph.output if o.name.endswith("_RetainedState")}
    ops = {n.op_type for n in nodes if not n.domain}
    assert not ops & {"Cos", "Sin"}
    assert check_model(model)[1] == []  # QEfficient's forms (tests/test_doctor.py)
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    cos = [n for n in nodes if n.op_type == "Gather" and n.input[0] == "rope.cos_cached"]
    assert cos and inits["rope.cos_cached"] == [arch.max_position_embeddings, arch.head_dim]
    logits = next(n for n in nodes if "logits" in n.output)
    assert logits.op_type == "MatMul" and inits[logits.input[1]] == [arch.hidden_size,
                                                                     arch.vocab_size]


@pytest.mark.parametrize("cb", [False, True], ids=["plain", "continuous-batching"])
def test_invalid_indices_are_int32_max_on_the_card_and_patched_for_onnxruntime(exported, cb):
    """The card graph gathers invalid KV slots at INT32_MAX and hands continuous batching's
    scatter INT32_MAX for a pad, as QEfficient's export does; ONNX Runtime refuses both, and
    the patched values (0 for reads, -1 for writes) put a prefill's pads in slot ctx_len-1."""
    path = exported("llama", "target", cb).onnx_path
    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
             if t.data_location != onnx.TensorProto.EXTERNAL}
    assert inits["invalid_gather_index"] == 2**31 - 1
    assert ("invalid_scatter_index" in inits) == cb
    if cb:
        assert inits["invalid_scatter_index"] == 2**31 - 1
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[5, 6, 0]]), "position_ids": np.array([[0, 1, -1]]),
             "num_logits_to_keep": np.zeros((1, 1), np.int64),
             **({"batch_index": np.array([[0]])} if cb else {}),
             **{i.name: np.zeros((1, i.shape[1], 8, i.shape[3]), np.float32)
                for i in sess.get_inputs() if i.name.startswith("past_")}}
    with pytest.raises(Exception, match="2147483647"):
        sess.run(None, feeds)
    drv = GraphDriver(path, 1, 32)
    prefill(lambda ids, pos, nlk: drv(ids, pos, nlk, batch_index=[0] if cb else None),
            list(range(5, 10)), 8)  # 5 tokens + 3 pads at position -1
    key = drv.kv["past_key.0"][0]  # [nKV, C, D]
    assert np.abs(key[:, :5]).sum() > 0 and np.abs(key[:, 5:-1]).sum() == 0
    assert np.abs(key[:, -1]).sum() > 0  # the pads' slot


# ------------------------------------------------------------------ 4b. the I/O contract


@pytest.mark.parametrize("cb", [False, True], ids=["plain", "continuous-batching"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_graph_io_contract_opset_and_metadata(role, cb, tiny_models, exported):
    result = exported("llama_untied_rope", role, cb)
    arch = result.arch
    onnx.checker.check_model(str(result.onnx_path), full_check=True)
    model = onnx.load(str(result.onnx_path), load_external_data=False)
    assert {(o.domain, o.version) for o in model.opset_import} == \
        {("", 17), ("com.qualcomm.cloud", 1), ("com.qti.aisw.onnx", 1)}
    assert sorted(p.name for p in result.onnx_path.parent.iterdir()) == [GRAPH_FILE, DATA_FILE]

    def sig(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            out.append((v.name, t.elem_type,
                        [d.dim_param or d.dim_value for d in t.shape.dim]))
        return out

    kv_batch = "full_batch_size" if cb else "batch_size"
    kv_shape = [kv_batch, arch.num_kv_heads, "ctx_len", arch.head_dim]
    I64, F32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    kv_names = [f"past_{kind}.{i}" for i in range(arch.num_layers) for kind in ("key", "value")]
    expected_in = [("input_ids", I64, ["batch_size", "seq_len"]),
                   ("position_ids", I64, ["batch_size", "seq_len"])]
    if cb:
        expected_in.append(("batch_index", I64, ["batch_size", 1]))
    expected_in += [(n, F32, kv_shape) for n in kv_names]
    if role == "target":
        expected_in.append(("num_logits_to_keep", I64, ["num_logits_to_keep", 1]))
    assert sig(model.graph.input) == expected_in

    outputs = sig(model.graph.output)
    assert outputs[0][0] == "logits" and outputs[0][1] == F32
    assert len(outputs[0][2]) == 3 and outputs[0][2][-1] == arch.vocab_size
    assert outputs[1:] == [(f"{n}_RetainedState", F32, kv_shape) for n in kv_names]

    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["role"] == role
    assert meta["qpcbuild_version"] == qpcbuild.__version__
    # Content only: no path, so the artifact is the same from any checkout.
    assert "source_model" not in meta and not any(str(tiny_models["llama_untied_rope"]) in v
                                                  for v in meta.values())
    assert len(meta["weights_digest"]) == 64 and meta["weights_digest"] == result.weights_digest
    assert meta["continuous_batching"] == str(cb).lower()
    assert meta == result.metadata


@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("variant", ["qwen2", "gemma3", "gpt_oss"])
def test_continuous_batching_batch_index_maps_rows_to_kv_slots(variant, role, exported):
    """Rows 0 and 1 of each call live in KV slots 2 and 0 of a pool of 3; logits equal the plain
    graph's, the pool slots hold the plain graph's rows, and the unused slot stays untouched."""
    plain = GraphDriver(exported(variant, role).onnx_path, 2, ctx_len=32)
    cbd = GraphDriver(exported(variant, role, cb=True).onnx_path, 2, ctx_len=32, kv_batch=3)
    slots = [2, 0]
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 256, (2, 20))
    lengths = [14, 10]
    expected = run_mixed_batch(plain, tokens, lengths, k=3)
    orig_call = cbd.__call__

    def with_index(ids, pos, nlk=1):
        return orig_call(ids, pos, nlk=nlk, batch_index=slots)

    drv_calls = run_mixed_batch(with_index, tokens, lengths, k=3)
    for step, logits in expected.items():
        assert_close(drv_calls[step], logits, tol=1e-5, what=f"cb {step}")
    for name, pool in cbd.kv.items():
        np.testing.assert_allclose(pool[slots], plain.kv[name], atol=1e-6, err_msg=name)
        assert not pool[1].any(), f"{name}: slot 1 was written"


# ------------------------------------------------------------------ 5. determinism


def test_reexport_is_byte_identical(tiny_models, tmp_path):
    src = resolve(str(tiny_models["qwen3"]))
    a = export_model(src, "target", tmp_path / "a")
    b = export_model(src, "target", tmp_path / "b")
    for name in (GRAPH_FILE, DATA_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert a.weights_digest == b.weights_digest and a.metadata == b.metadata


def test_weights_digest_is_independent_of_sharding(tiny_models, tmp_path):
    sharded = tiny_models["llama_sharded"]
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 1
    single = export_model(resolve(str(tiny_models["llama"])), "draft", tmp_path / "single")
    multi = export_model(resolve(str(sharded)), "draft", tmp_path / "sharded")
    assert single.weights_digest == multi.weights_digest
    assert (tmp_path / "single" / DATA_FILE).read_bytes() == \
        (tmp_path / "sharded" / DATA_FILE).read_bytes()


def test_weights_digest_changes_when_a_weight_changes(tiny_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    base = export_model(resolve(str(model_dir)), "draft", tmp_path / "a").weights_digest
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + np.float32(1e-3)
    save_file(tensors, model_dir / "model.safetensors")
    assert export_model(resolve(str(model_dir)), "draft", tmp_path / "b").weights_digest != base


# ------------------------------------------------------------------ 6. float16 weights


def test_float16_weight_export_stays_close_to_transformers(tiny_models, exported):
    result = exported("llama_untied_rope", "target", dtype="float16")
    assert result.metadata["weight_dtype"] == "float16"
    rng = np.random.default_rng(3)
    tokens, lengths, k = rng.integers(0, 256, (2, 20)), [14, 10], 3
    ref = [hf_logits(tiny_models["llama_untied_rope"], tokens[r, :n + k + 2])
           for r, n in enumerate(lengths)]
    steps = run_mixed_batch(GraphDriver(result.onnx_path, 2, ctx_len=32), tokens, lengths, k)
    for r, n in enumerate(lengths):
        assert_close(steps["decode"][r, 0], ref[r][n], tol=2e-2, what="fp16 decode")
        assert_close(steps["verify"][r], ref[r][n + 1:n + 2 + k], tol=2e-2, what="fp16 verify")
    # Checkpoint tensors are stored in float16; only the RoPE tables, computed here in float32
    # as transformers computes them, stay float32.
    model = onnx.load(str(result.onnx_path), load_external_data=False)
    stored = {t.name: t.data_type for t in model.graph.initializer
              if t.data_location == onnx.TensorProto.EXTERNAL}
    assert {n for n, t in stored.items() if t != onnx.TensorProto.FLOAT16} == \
        {"rope.cos_cached", "rope.sin_cached"}
    # the plan and manifest describe the graph's I/O as the graph has it, in its order
    from qpcbuild.models.graph_io import graph_io

    def described(values):
        return [(v.name, onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                 [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
                for v in values]

    planned = graph_io("target", result.arch, False)
    for side, values in (("inputs", model.graph.input), ("outputs", model.graph.output)):
        assert [(e["name"], e["dtype"], e["shape"]) for e in planned[side]] == described(values)


# ------------------------------------------------------------------ 7. bad input


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _expect_clean_failure(model_dir: Path, out_root: Path, *needles: str,
                          error=UsageError) -> QpcbuildError:
    """Export fails with `error` naming every needle, and leaves nothing under out_root."""
    with pytest.raises(error) as info:
        export_model(resolve(str(model_dir)), "target", out_root / "graph")
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in error message: {message}"
    leftovers = sorted(p.name for p in out_root.iterdir()) if out_root.exists() else []
    assert leftovers == [], f"export left {leftovers} behind"
    return info.value


def test_missing_config_is_refused(tiny_models, tmp_path):
    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    (model_dir / "config.json").unlink()
    _expect_clean_failure(model_dir, tmp_path / "out", "config.json", str(model_dir))


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                               n_positions=32)).save_pretrained(model_dir)
    _expect_clean_failure(model_dir, tmp_path / "out", "config.json", "GPT2LMHeadModel",
                          "LlamaForCausalLM")


def test_index_naming_a_missing_shard_is_refused(tiny_models, tmp_path):
    model_dir = _copy(tiny_models["llama_sharded"], tmp_path / "m")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (model_dir / gone).unlink()
    _expect_clean_failure(model_dir, tmp_path / "out", gone, "model.safetensors.index.json")


@pytest.mark.parametrize("keep", [0.6, 0.001], ids=["data-cut", "header-cut"])
def test_truncated_shard_is_refused(keep, tiny_models, tmp_path):
    model_dir = _copy(tiny_models["llama_untied_rope"], tmp_path / "m")
    shard = model_dir / "model.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:int(len(raw) * keep)])
    _expect_clean_failure(model_dir, tmp_path / "out", str(shard), "truncated")


def test_tensor_with_wrong_shape_is_refused(tiny_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    model_dir = _copy(tiny_models["llama_untied_rope"], tmp_path / "m")
    shard = model_dir / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].copy()
    save_file(tensors, shard, metadata={"format": "pt"})
    _expect_clean_failure(model_dir, tmp_path / "out", name, str(shard), "shape")


def test_unsupported_tensor_dtype_is_refused(tiny_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    model_dir = _copy(tiny_models["qwen2"], tmp_path / "m")
    shard = model_dir / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = np.ones(tensors[name].shape, np.int8)
    save_file(tensors, shard, metadata={"format": "pt"})
    _expect_clean_failure(model_dir, tmp_path / "out", name, str(shard), "I8")


def test_tokenizer_larger_than_vocab_is_refused(tiny_models, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    vocab = {f"tok{i}": i for i in range(300)}  # the model's vocab_size is 256
    Tokenizer(WordLevel(vocab, unk_token="tok0")).save(str(model_dir / "tokenizer.json"))
    _expect_clean_failure(model_dir, tmp_path / "out", "tokenizer.json", "300", "256")


def test_pickle_only_checkpoint_is_refused(tiny_models, tmp_path):
    from safetensors.torch import load_file

    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    torch.save(load_file(model_dir / "model.safetensors"), model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()
    err = _expect_clean_failure(model_dir, tmp_path / "out", "pytorch_model.bin")
    assert "allow_pickle" in str(err)
    # Opting in lists the pickle file instead of refusing it outright.
    assert safetensors_files(model_dir, allow_pickle=True) == [model_dir / "pytorch_model.bin"]


def test_pickle_checkpoint_exports_identically_when_the_user_opts_in(tiny_models, tmp_path):
    from safetensors.torch import load_file

    model_dir = _copy(tiny_models["llama"], tmp_path / "m")
    torch.save(load_file(model_dir / "model.safetensors"), model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()
    opted = export_model(resolve(str(model_dir)), "target", tmp_path / "pickle", allow_pickle=True)
    reference = export_model(resolve(str(tiny_models["llama"])), "target", tmp_path / "st")
    assert opted.weights_digest == reference.weights_digest
    assert (tmp_path / "pickle" / "model.onnx.data").read_bytes() == \
        (tmp_path / "st" / "model.onnx.data").read_bytes()


@pytest.mark.parametrize("where", ["weights", "graph"])
def test_disk_full_while_writing_leaves_nothing_behind(where, tiny_models, tmp_path, monkeypatch):
    import qpcbuild.export.model as export_pkg

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "weights":  # fail after a few tensors have been streamed to model.onnx.data
        real_weight, calls = GraphBuilder.weight, []

        def weight(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > 3:
                no_space()
            return real_weight(self, *args, **kwargs)

        monkeypatch.setattr(GraphBuilder, "weight", weight)
    else:  # fail half-way through writing model.onnx
        def save(model, path):
            path.write_bytes(model.SerializeToString()[:100])
            no_space()

        monkeypatch.setattr(export_pkg, "save", save)
    err = _expect_clean_failure(tiny_models["llama"], tmp_path / "out", "No space left",
                                str(tmp_path / "out" / "graph"), error=QpcbuildError)
    assert isinstance(err, QpcbuildError)


# ------------------------------------------------------------------ streamed weights
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_stored_tensor_finds_nan_and_inf_from_its_bits_like_numpy(dtype):
    from qpcbuild.models.safetensors import StoredTensor

    rng = np.random.default_rng(0)
    bits = np.uint32 if dtype == "F32" else np.uint16
    # random bit patterns cover every exponent, NaN payloads and the largest finite values
    raw = rng.integers(0, np.iinfo(bits).max, size=(257, 9), dtype=np.uint64).astype(bits)
    values = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[dtype])
    t = StoredTensor(values, dtype, "")
    finite_rows = [r for r in range(len(raw)) if np.isfinite(t.widen(values[r])).all()]
    assert 0 < len(finite_rows) < len(raw)
    for r in range(len(raw)):  # numpy's verdict on the widened float32 values is the oracle
        row = StoredTensor(values[r:r + 1], dtype, "")
        assert row.non_finite() == (r not in finite_rows), (dtype, r)


@pytest.mark.parametrize("layout", ["plain", "transposed", "strided"])
def test_weights_are_written_in_blocks_exactly_as_one_copy(layout, monkeypatch):
    """Small blocks and tiles force the multi-block path that multi-GB matrices take."""
    import qpcbuild.export.builder as builder

    monkeypatch.setattr(builder, "BLOCK_ELEMENTS", 97)
    monkeypatch.setattr(builder, "TILE", 5)
    rng = np.random.default_rng(1)  # bfloat16 bits of values within float16's range, both signs
    bf16 = rng.integers(0, 0x4700, size=(23, 41), dtype=np.uint16) | \
        (rng.integers(0, 2, size=(23, 41), dtype=np.uint16) << 15)
    arr = {"plain": bf16, "transposed": bf16.T, "strided": bf16[::2, 1::3]}[layout]
    def widen(part):
        return (part.astype(np.uint32) << 16).view(np.float32)
    for dtype in (np.float32, np.float16):
        blocks = [b.copy() for b in builder._c_order_blocks(arr, np.dtype(dtype), widen)]
        assert len(blocks) > 1
        np.testing.assert_array_equal(np.concatenate(blocks),
                                      np.ascontiguousarray(widen(arr)).astype(dtype))

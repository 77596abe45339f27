"""Shared pytest fixtures."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# ==================================================================================================
# BEGIN tiny-checkpoints block (export tests): small real Hugging Face checkpoints built locally.
# ==================================================================================================

TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, intermediate_size=128, max_position_embeddings=512)
# Passed as `rope_scaling`, which transformers 4.x takes natively and 5.x converts into
# `rope_parameters` (the form then written to config.json).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small, so that the scaling changes frequencies at the tiny head_dim used here
               "original_max_position_embeddings": 32}


def _randomize(model, seed: int) -> None:
    """Weights large enough that logits are O(1) and norms/biases actually matter."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):  # every RMSNorm, including Qwen3's q_norm / k_norm
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith((".bias", "_bias", ".sinks")):  # biases, GPT-OSS's sinks
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.15 * noise)


# Windows shorter than the tested contexts (prompts of 10-20 tokens in a ctx_len of 32-64), so the
# sliding layers' mask is exercised; Gemma 3 with sliding and full layers alternating, each with
# its RoPE base, a query_pre_attn_scalar that is not head_dim and a final soft-cap; Gemma 2 with
# transformers' default soft-caps (50 on scores, 30 on logits).
GEMMA_SHAPE = dict(TINY_SHAPE, head_dim=16, sliding_window=6)


def _tiny_variants():
    from transformers import (Gemma2Config, Gemma3TextConfig, GptOssConfig, GraniteConfig,
                              LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)

    return {
        # name: (config, dtype written to disk)
        "llama": (LlamaConfig(**TINY_SHAPE, tie_word_embeddings=True), "float32"),
        "llama_untied_rope": (LlamaConfig(**TINY_SHAPE, tie_word_embeddings=False, head_dim=32,
                                          rope_scaling=dict(LLAMA3_ROPE)), "float32"),
        "llama_bf16": (LlamaConfig(**TINY_SHAPE, tie_word_embeddings=False), "bfloat16"),
        "mistral": (MistralConfig(**TINY_SHAPE, head_dim=16, tie_word_embeddings=False),
                    "float32"),
        "qwen2": (Qwen2Config(**TINY_SHAPE, tie_word_embeddings=False), "float32"),
        "qwen3": (Qwen3Config(**TINY_SHAPE, head_dim=16, tie_word_embeddings=False), "float32"),
        "mistral_sliding": (MistralConfig(**TINY_SHAPE, head_dim=16, sliding_window=5,
                                          tie_word_embeddings=False), "float32"),
        "gemma3": (Gemma3TextConfig(**GEMMA_SHAPE, sliding_window_pattern=2,
                                    query_pre_attn_scalar=24, final_logit_softcapping=3.0),
                   "float32"),
        "gemma2": (Gemma2Config(**GEMMA_SHAPE, query_pre_attn_scalar=16), "float32"),
        "gemma3_bf16": (Gemma3TextConfig(**GEMMA_SHAPE), "bfloat16"),
        # multipliers far from 1 (Granite 3's are 12 / 0.0078 / 0.22 / 8), so each one shows
        "granite": (GraniteConfig(**TINY_SHAPE, embedding_multiplier=3.0,
                                  attention_multiplier=0.05, residual_multiplier=0.4,
                                  logits_scaling=2.5, tie_word_embeddings=True), "float32"),
        # fused qkv / gate_up, RoPE on 12 of 16 head dims, longrope (its short factors: ctx_len
        # stays within original_max_position_embeddings) with an attention factor from 512 / 128
        "phi3": (Phi3Config(**TINY_SHAPE, head_dim=16, partial_rotary_factor=0.75,
                            original_max_position_embeddings=128, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                            rope_scaling={"rope_type": "longrope",
                                          "short_factor": [1.0 + 0.4 * i for i in range(6)],
                                          "long_factor": [4.0] * 6}), "float32"),
        # 4 experts, 2 per token; Qwen3-MoE with a dense layer (mlp_only_layers) and without
        # renormalizing the top 2, Mixtral (which always renormalizes) with a window of 6
        "qwen3_moe": (Qwen3MoeConfig(**TINY_SHAPE, head_dim=16, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                     mlp_only_layers=[1], norm_topk_prob=False,
                                     tie_word_embeddings=False), "float32"),
        "mixtral": (MixtralConfig(**TINY_SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                  sliding_window=6, tie_word_embeddings=False), "float32"),
        # sinks, sliding (6) and full layers alternating, YaRN (factor 4 over 64 positions),
        # q/k/v/o biases, 4 stacked experts with biases and a clamped SwiGLU (limit 1.5, so the
        # random weights reach the clamp)
        "gpt_oss": (GptOssConfig(**dict(TINY_SHAPE, intermediate_size=32), head_dim=16,
                                 num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                 swiglu_limit=1.5, eos_token_id=2, bos_token_id=1,
                                 pad_token_id=0, rope_scaling={
                                     "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 64}), "float32"),
    }



@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Folders of tiny random checkpoints (config.json + safetensors), one per family variant,
    plus "llama_sharded": the "llama" weights saved as an index and several small shards."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("tiny_models")
    out: dict[str, Path] = {}
    # A bundle carries the target's tokenizer: a word-level one over the tiny vocabulary.
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY_SHAPE["vocab_size"])},
                                     unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    for seed, (name, (config, dtype)) in enumerate(_tiny_variants().items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        _randomize(model, seed)
        if dtype == "bfloat16":
            model = model.to(torch.bfloat16)
        out[name] = root / name
        model.save_pretrained(out[name], safe_serialization=True)
        tok.save(str(out[name] / "tokenizer.json"))
        if name == "llama":
            out["llama_sharded"] = root / "llama_sharded"
            model.save_pretrained(out["llama_sharded"], safe_serialization=True,
                                  max_shard_size="40KB")
            tok.save(str(out["llama_sharded"] / "tokenizer.json"))
    return out

# ==================================================================================================
# END tiny-checkpoints block
# ==================================================================================================


# ==================================================================================================
# The real pair (tests marked real_model): SmolLM2-135M-Instruct, fetched and converted by
# `make smollm2`, and the draft trained for it (committed under models/smollm2-draft).
# ==================================================================================================

MODELS = Path(__file__).resolve().parents[1] / "models"
REAL_TARGET = MODELS / "smollm2-135m-instruct"
REAL_DRAFT = MODELS / "smollm2-draft"


def real_model_missing() -> str | None:
    """Why the real target cannot be used here, or None. CI sets QPCBUILD_REAL_MODEL=required,
    so that a missing model fails these tests instead of skipping them."""
    if (REAL_TARGET / "conversion.json").is_file() and (REAL_DRAFT / "config.json").is_file():
        return None
    return _unless_required(f"{REAL_TARGET} is missing (run `make smollm2`)")


def _unless_required(why: str) -> str:
    """`why` a real model is missing, to skip with; a failure instead where
    QPCBUILD_REAL_MODEL=required (CI)."""
    import os

    if os.environ.get("QPCBUILD_REAL_MODEL") == "required":
        pytest.fail(why + "; QPCBUILD_REAL_MODEL=required", pytrace=False)
    return why


@pytest.fixture(scope="session")
def real_pair() -> tuple[Path, Path]:
    why = real_model_missing()
    if why:
        pytest.skip(why)
    return REAL_TARGET, REAL_DRAFT


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory) -> tuple[Path, Path]:
    """(bundle, cache) of recipes/demo.yaml, built once for the tests that only read it or copy
    it before changing it (hardening tests: server, manifest checks, inputs, crash safety)."""
    from typer.testing import CliRunner

    from qpcbuild.cli import app

    tmp = tmp_path_factory.mktemp("demo-build")
    root = Path(__file__).resolve().parents[1]
    result = CliRunner().invoke(app, ["compile", str(root / "recipes" / "demo.yaml"), "-o",
                                      str(tmp / "bundle"), "--cache-dir", str(tmp / "cache")])
    assert result.exit_code == 0, result.output
    return tmp / "bundle", tmp / "cache"

# ==================================================================================================
# The published pair (tests marked real_model): Qwen2.5-Coder-1.5B-Instruct + 0.5B-Instruct,
# fetched and converted by `make qwen-coder` (scripts/get_models.py).
# ==================================================================================================

QWEN_TARGET = MODELS / "qwen2.5-coder-1.5b-instruct"
QWEN_DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct"


def qwen_coder_missing() -> str | None:
    """Why the Qwen2.5-Coder pair (the heavy tier) is not used here, or None. Skipped on
    request (QPCBUILD_HEAVY=skip); a missing pair fails instead of skipping when
    QPCBUILD_HEAVY=required or QPCBUILD_REAL_MODEL=required, as in CI."""
    import os

    heavy = os.environ.get("QPCBUILD_HEAVY", "")
    if heavy == "skip":
        return "the heavy tier (Qwen2.5-Coder) is skipped: QPCBUILD_HEAVY=skip"
    missing = [p for p in (QWEN_TARGET, QWEN_DRAFT) if not (p / "conversion.json").is_file()]
    if not missing:
        return None
    why = f"{missing[0]} is missing (run `make qwen-coder`)"
    if heavy == "required":
        pytest.fail(why + "; QPCBUILD_HEAVY=required", pytrace=False)
    return _unless_required(why)


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    why = qwen_coder_missing()
    if why:
        pytest.skip(why)
    return QWEN_TARGET, QWEN_DRAFT


# ==================================================================================================
# Gemma 3 270M (tests marked real_model), fetched and converted by `make gemma3`
# (scripts/get_models.py): the family with sliding-window layers, on its real weights.
# ==================================================================================================

GEMMA3_MODEL = MODELS / "gemma-3-270m"


def gemma3_missing() -> str | None:
    """Why Gemma 3 270M cannot be used here, or None (a failure where it is required, in CI)."""
    if (GEMMA3_MODEL / "conversion.json").is_file():
        return None
    return _unless_required(f"{GEMMA3_MODEL} is missing (run `make gemma3`)")


@pytest.fixture(scope="session")
def gemma3_model() -> Path:
    why = gemma3_missing()
    if why:
        pytest.skip(why)
    return GEMMA3_MODEL


@pytest.fixture
def peer_manifest():
    """qpcbuild.testing.small_manifest: a checked Manifest whose roles' checkpoints are the
    folders given (the peer tests that need no built bundle)."""
    from qpcbuild.testing import small_manifest

    return small_manifest


# ==================================================================================================
# The qaic backend's tiny pair (test_qaic_backend.py, test_finish_handoff.py; the recipe, build and
# stand-in compiler are in tests/helpers_qaic.py). no_qaic_sdk is not autouse: those modules ask
# for it in their pytestmark.
# ==================================================================================================

@pytest.fixture(scope="session")
def qaic_models(tmp_path_factory) -> dict[str, Path]:
    """A two-layer Llama target and a one-layer draft sharing a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers_qaic import LAYERS

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    root = tmp_path_factory.mktemp("qaic-models")
    out = {}
    for seed, (role, hidden) in enumerate((("target", 64), ("draft", 32))):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=LAYERS[role], num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        folder = root / role
        LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
        tok.save(str(folder / "tokenizer.json"))
        out[role] = folder
    return out


@pytest.fixture
def no_qaic_sdk(monkeypatch, tmp_path) -> tuple[str, str]:
    """This machine has no SDK; make sure the tests behave the same on one that does."""
    import qpcbuild.backends.qaic.plan as qaic_plan

    fake = (str(tmp_path / "sdk" / "qaic-compile"), str(tmp_path / "sdk" / "qaic-exec"))
    monkeypatch.setattr(qaic_plan, "QAIC_COMPILERS", fake)
    monkeypatch.delenv("QAIC_COMPILER", raising=False)
    return fake


@pytest.fixture
def qaic_recipe(qaic_models, tmp_path) -> Path:
    from helpers_qaic import write_recipe

    return write_recipe(tmp_path, qaic_models)


# ==================================================================================================
# A real OCI registry and the demo bundle to push to it (test_registry.py,
# test_registry_signatures.py; the server is tests/registry_server.py, compile and push are in
# tests/helpers_registry.py), each started or built once per session. Every test pushes under
# repository names of its own, so the modules share one registry.
# ==================================================================================================

@pytest.fixture(scope="session")
def demo_checkout(tmp_path_factory) -> Path:
    """A copy of the checkout's models/demo and recipes: the recipes name the models relatively."""
    repo = Path(__file__).resolve().parents[1]
    root = tmp_path_factory.mktemp("checkout")
    shutil.copytree(repo / "models" / "demo", root / "models" / "demo")
    shutil.copytree(repo / "recipes", root / "recipes")
    return root


@pytest.fixture(scope="session")
def oci_registry(tmp_path_factory):
    from registry_server import start_registry

    server = start_registry(tmp_path_factory.mktemp("registry"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def registry_demo_bundle(demo_checkout, tmp_path_factory) -> Path:
    from helpers_registry import compile_demo

    out = tmp_path_factory.mktemp("bundles") / "demo"
    compile_demo(demo_checkout, out, out.parent / "cache")
    return out


# ==================================================================================================
# Disk: a module's scratch folders go when the module ends, not when the session does.
# pytest removes a passing test's `tmp_path` at once, but keeps every `tmp_path_factory.mktemp`
# folder to the end of the session; the module-scoped fixtures here build real-model bundles of
# GBs each, and kept side by side they once filled a CI machine's disk. A folder made while a
# module- (class-, package-) scoped fixture was being set up is removed after that fixture's own
# teardown; a session-scoped fixture's folders stay to the end (a module fixture that first
# asks for a session fixture does not claim that fixture's folders). QPCBUILD_KEEP_TEST_DIRS=1
# keeps everything, for debugging a failure.
# ==================================================================================================

_SCOPED_SCRATCH: dict[int, list[Path]] = {}  # id(fixturedef) -> the folders its setup made
_CLAIMED: set[str] = set()  # basetemp entries already attributed to a fixture


def _basetemp_entries(config) -> set[str] | None:
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return None
    root = factory.getbasetemp()
    return {p.name for p in root.iterdir()}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    import os

    if fixturedef.scope == "function" or os.environ.get("QPCBUILD_KEEP_TEST_DIRS") == "1":
        return (yield)
    before = _basetemp_entries(request.config)
    try:
        return (yield)
    finally:
        after = _basetemp_entries(request.config)
        if before is not None and after is not None:
            made = sorted(after - before - _CLAIMED)
            _CLAIMED.update(made)
            if fixturedef.scope != "session" and made:
                root = request.config._tmp_path_factory.getbasetemp()
                _SCOPED_SCRATCH.setdefault(id(fixturedef), []).extend(root / m for m in made)


def pytest_fixture_post_finalizer(fixturedef, request):
    for folder in _SCOPED_SCRATCH.pop(id(fixturedef), []):
        shutil.rmtree(folder, ignore_errors=True)

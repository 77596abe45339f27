"""The families beyond Llama's block (Gemma 3, Gemma 2, Granite, Phi-3, Qwen3-MoE, Mixtral,
GPT-OSS) and sliding windows shorter than the context (Mistral's, Gemma's, GPT-OSS's) as
speculative targets, on tiny random checkpoints made with transformers' own classes
(tests/conftest.py): greedy speculative decoding through a built bundle equals transformers'
`generate`, the plan refuses the fused ONNX Runtime lowering where it does not apply and names
the fix, and a card recipe for a Gemma 3 target plans and emits.

The graph's logits against transformers' forward (prefill, pads, decode, verify window, stale
window, continuous batching) are tested in test_export.py for every family variant.
"""

from __future__ import annotations


import numpy as np
import onnx
import pytest

from qpcbuild.bundle import verify_bundle
from qpcbuild.errors import RecipeError
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe
from qpcbuild.runtime.loader import load

from helpers_families import NEW_TOKENS, hf_greedy, prompts, write_recipe
from helpers_qaic import build  # recipe -> plan -> bundle, as the CLI's compile does

# Every prompt is longer than the variants' windows (5-6), so the sliding layers mask keys;
# Granite (multipliers), Phi-3 (fused projections, partial longrope) and Qwen3-MoE have none.
# GPT-OSS: sinks, window 6, YaRN, stacked experts with a clamped SwiGLU.
SPD_VARIANTS = ("gemma3", "gemma2", "mistral_sliding", "granite", "phi3", "qwen3_moe", "mixtral",
                "gpt_oss")
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("variant", SPD_VARIANTS)
def test_greedy_speculative_decoding_equals_transformers_generate(variant, method, tiny_models,
                                                                  tmp_path):
    target = tiny_models[variant]
    out = tmp_path / "bundle"
    build(write_recipe(tmp_path, target, method), tmp_path / "cache", out)
    gen = load(out)
    for ids in prompts(len(variant)):
        ours = gen.generate([ids], max_new_tokens=NEW_TOKENS).rows[0].tokens[len(ids):]
        assert ours == hf_greedy(target, ids), (variant, method, ids)


def test_gemma2_draft_model_speeds_a_gemma3_target_and_output_equals_generate(tiny_models,
                                                                             tmp_path):
    """A Gemma draft graph in the loop too (the tiny variants share one tokenizer)."""
    target, draft = tiny_models["gemma3"], tiny_models["gemma2"]
    out = tmp_path / "bundle"
    build(write_recipe(tmp_path, target, "draft_model", draft=draft), tmp_path / "cache", out)
    gen = load(out)
    for ids in prompts(11):
        ours = gen.generate([ids], max_new_tokens=NEW_TOKENS).rows[0].tokens[len(ids):]
        assert ours == hf_greedy(target, ids), ids


@pytest.mark.parametrize("variant", ["gpt_oss", "phi3"])
def test_fused_lowering_is_refused_where_it_does_not_apply_and_the_fix_is_named(
        variant, tiny_models, tmp_path):
    recipe = write_recipe(tmp_path, tiny_models[variant], "ngram", graph="fused")
    with pytest.raises(RecipeError) as err:
        make_plan(load_recipe(recipe))
    text = str(err.value)
    assert "onnxruntime.graph" in text and "portable" in text


def test_longrope_context_past_its_pretraining_length_is_refused(tiny_models, tmp_path):
    """Phi-3's longrope switches to long factors past original_max_position_embeddings (128
    here) for every position at once; the plan says so instead of building a wrong cache."""
    recipe = write_recipe(tmp_path, tiny_models["phi3"], "ngram", ctx_len=256)
    with pytest.raises(RecipeError) as err:
        make_plan(load_recipe(recipe))
    assert "shapes.ctx_len" in str(err.value) and "original_max_position_embeddings (128)" in \
        str(err.value)


@pytest.mark.parametrize("variant", ["gemma3", "gemma2", "mistral_sliding"])
def test_fused_lowering_plans_for_gemma_and_windows_shorter_than_ctx_len(variant, tiny_models,
                                                                        tmp_path):
    """ctx_len 64 over windows of 5-6: the sliding layers are GroupQueryAttention's local
    window (test_fused_families.py checks the graph against transformers)."""
    recipe = write_recipe(tmp_path, tiny_models[variant], "ngram", graph="fused")
    plan = make_plan(load_recipe(recipe))
    assert plan.role("target").backends["onnxruntime"].graph == "fused"


def test_fused_lowering_runs_granite_with_its_multipliers_and_equals_generate(tiny_models,
                                                                             tmp_path):
    """Granite on the fused graph: the scores' multiplier is GroupQueryAttention's scale, the
    embedding and residual multipliers and the logits divisor are Muls and a Div around it."""
    target = tiny_models["granite"]
    out = tmp_path / "bundle"
    build(write_recipe(tmp_path, target, "ngram", graph="fused"), tmp_path / "cache", out)
    graph = onnx.load(str(out / "target" / "ort" / "model.onnx"), load_external_data=False)
    assert "GroupQueryAttention" in {n.op_type for n in graph.graph.node}
    gen = load(out)
    for ids in prompts(5):
        ours = gen.generate([ids], max_new_tokens=NEW_TOKENS).rows[0].tokens[len(ids):]
        assert ours == hf_greedy(target, ids), ids


def test_card_recipe_for_a_gemma3_target_plans_and_emits(tiny_models, tmp_path, no_qaic_sdk):
    """qaic + onnxruntime: the card's compiler inputs are written (no SDK here: --emit-only)."""
    recipe = write_recipe(tmp_path, tiny_models["gemma3"], "ngram",
                          backends="[qaic, onnxruntime]")
    plan = make_plan(load_recipe(recipe))
    assert plan.role("target").arch.family == "gemma3"
    out = tmp_path / "bundle"
    build(recipe, tmp_path / "cache", out, emit_only=True)
    for f in ("onnx/model.onnx", "qaic/specializations.json", "qaic/compile.sh", "ort/model.onnx"):
        assert (out / "target" / f).is_file(), f
    assert verify_bundle(out) == []


def test_doctor_says_plainly_that_a_gemma3_verify_graph_is_qpcbuilds_own(tiny_models, tmp_path):
    from qpcbuild.bundle.doctor import check_graph
    from qpcbuild.export import export_model
    from qpcbuild.models.source import resolve

    gemma = export_model(resolve(str(tiny_models["gemma3"])), "target", tmp_path / "gemma3")
    report = check_graph(gemma.onnx_path)
    assert "qpcbuild's own" in report["note"] and "Gemma 3" in report["note"]
    flagged = " | ".join(report["findings"])
    assert "LessOrEqual" in flagged and "Tanh" in flagged  # the window mask, GELU's tanh form
    # the (1 + w) norm weights are initializers, as CustomRMSNorm takes them from QEfficient
    assert "weight from" not in flagged, flagged
    llama = export_model(resolve(str(tiny_models["llama"])), "target", tmp_path / "llama")
    assert "note" not in check_graph(llama.onnx_path)


def test_gpt_oss_mxfp4_experts_are_refused_with_the_way_to_dequantize(tiny_models, tmp_path):
    """The released GPT-OSS checkpoints pack their experts as MXFP4 blocks and scales; the
    error says so and how to get float weights, instead of listing missing tensors."""
    from safetensors.numpy import load_file, save_file

    from qpcbuild.errors import UsageError
    from qpcbuild.export import export_model
    from qpcbuild.models.source import resolve

    folder = tmp_path / "packed"
    folder.mkdir()
    for f in tiny_models["gpt_oss"].iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).symlink_to(f)
    tensors = load_file(tiny_models["gpt_oss"] / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name + "_blocks"] = tensors.pop(name).view(np.uint8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(UsageError, match="MXFP4.*dequantize"):
        export_model(resolve(str(folder)), "target", tmp_path / "out")

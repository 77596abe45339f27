"""The ONNX Runtime form of the mixture-of-experts families (Qwen3-MoE, Mixtral, GPT-OSS): each
routed layer as one com.microsoft.MoE node, which runs only the experts a token chose
(backends/onnxruntime/moe.py), while the card graph keeps the dense form. Checked against
transformers' forward on the tiny checkpoints (tests/conftest.py) and in a built bundle.
Greedy speculative decoding through such bundles equals `generate` in test_families.py."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from qpcbuild.backends.onnxruntime.moe import MOE_FORM, rebuild_with_moe_op
from qpcbuild.errors import RecipeError
from qpcbuild.export import DATA_FILE, export_model
from qpcbuild.models.source import resolve
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe
from qpcbuild.runtime.loader import load

from helpers_export import GraphDriver, hf_logits, run_mixed_batch
from helpers_qaic import build
from helpers_families import NEW_TOKENS, hf_greedy, prompts, write_recipe

MOE_VARIANTS = ("qwen3_moe", "mixtral", "gpt_oss")
TOL = 1e-4


def moe_op_graph(model: Path, root: Path, role: str = "target", cb: bool = False) -> Path:
    """The exported graph of `model` and its MoE-kernel rebuild, as the ORT backend makes it."""
    res = export_model(resolve(str(model)), role, root / "export", continuous_batching=cb)
    work = root / "ort"
    work.mkdir()
    os.link(res.onnx_path.parent / DATA_FILE, work / DATA_FILE)
    return rebuild_with_moe_op(res.onnx_path.parent, work, res.arch)


def ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_moe_kernel_graph_matches_transformers_for_prefill_padding_decode_and_verify(
        variant, tiny_models, tmp_path):
    path, k, lengths = tiny_models[variant], 3, [14, 10]
    graph = moe_op_graph(path, tmp_path)
    # one MoE node per routed layer and no dense expert: Qwen3-MoE's layer 1 is a dense MLP
    routed = {"qwen3_moe": 1, "mixtral": 2, "gpt_oss": 2}[variant]
    assert ops(graph)["MoE"] == routed
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 256, (2, max(lengths) + k + 2))
    ref = [hf_logits(path, tokens[r, :n + k + 2]) for r, n in enumerate(lengths)]
    steps = run_mixed_batch(GraphDriver(graph, 2, ctx_len=32), tokens, lengths, k)
    expect = {"chunk1": [7, 7], "chunk2": [n - 1 for n in lengths], "decode": lengths}
    for step, rows in expect.items():
        for r, row in enumerate(rows):
            diff = np.abs(steps[step][r, 0] - ref[r][row]).max()
            assert diff <= TOL, (variant, step, r, diff)
    for r, n in enumerate(lengths):  # the K+1 verify window, one logit row per position
        diff = np.abs(steps["verify"][r] - ref[r][n + 1:n + 2 + k]).max()
        assert diff <= TOL, (variant, "verify", r, diff)


def test_moe_kernel_graph_with_continuous_batching_routes_rows_to_their_kv_slots(
        tiny_models, tmp_path):
    """A draft graph with batch_index: two rows written into slots 2 and 0 of a pool of 3."""
    path = tiny_models["qwen3_moe"]
    drv = GraphDriver(moe_op_graph(path, tmp_path, role="draft", cb=True), 2, ctx_len=32,
                      kv_batch=3)
    tokens = np.random.default_rng(3).integers(4, 256, (2, 9))
    drv(tokens[:, :8], np.tile(np.arange(8), (2, 1)), batch_index=[2, 0])
    out = drv(tokens[:, 8:], np.array([[8], [8]]), batch_index=[2, 0])
    for r in range(2):
        diff = np.abs(out[r, 0] - hf_logits(path, tokens[r])[8]).max()
        assert diff <= TOL, (r, diff)


def test_onnxruntime_artifact_of_a_moe_target_holds_folded_expert_stacks(tiny_models, tmp_path):
    """The bundle's portable ORT artifact: MoE nodes fed by single stacked initializers (ORT's
    optimizer folded the Concats that build them), no per-expert MatMul left; the manifest
    records the form. The card graph of the same recipe keeps the dense form (doctor reads it)."""
    out = tmp_path / "bundle"
    build(write_recipe(tmp_path, tiny_models["mixtral"], "ngram"), tmp_path / "cache", out)
    artifact = out / "target" / "ort" / "model.onnx"
    model = onnx.load(str(artifact), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    moe = [n for n in model.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2
    for node in moe:  # fc1 (gate and up interleaved) and fc2 (down): folded, not computed
        assert node.input[2] in initializers and node.input[4] in initializers
    # per layer q/k/v/o, scores, probs x values and the router, plus the head: none per expert
    # (the dense form adds 3 per expert, 12 per layer here)
    matmuls = sum(1 for n in model.graph.node if n.op_type in ("MatMul", "FusedMatMul"))
    assert matmuls <= 2 * 7 + 1, matmuls
    manifest = json.loads((out / "manifest.json").read_text())
    assert MOE_FORM in json.dumps(manifest)


def without_window(model: Path, folder: Path) -> Path:
    """`model` with config.json's sliding_window removed (transformers then attends to every
    position too): a Mixtral the fused lowering can run at any ctx_len."""
    folder.mkdir()
    for f in model.iterdir():
        os.link(f, folder / f.name)
    config = json.loads((model / "config.json").read_text())
    config["sliding_window"] = None
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_fused_lowering_runs_routed_layers_on_the_moe_kernel_and_equals_generate(
        variant, tiny_models, tmp_path):
    """Qwen3-MoE (a dense layer among routed ones, top 2 not renormalized) and Mixtral on the
    fused graph: GroupQueryAttention and the MoE kernel; greedy n-gram SpD equals `generate`."""
    target = tiny_models[variant]
    if variant == "mixtral":
        target = without_window(target, tmp_path / "mixtral-no-window")
    out = tmp_path / "bundle"
    build(write_recipe(tmp_path, target, "ngram", graph="fused"), tmp_path / "cache", out)
    assert ops(out / "target" / "ort" / "model.onnx")["MoE"] == (1 if variant == "qwen3_moe"
                                                                  else 2)
    gen = load(out)
    for ids in prompts(7):
        ours = gen.generate([ids], max_new_tokens=NEW_TOKENS).rows[0].tokens[len(ids):]
        assert ours == hf_greedy(target, ids), (variant, ids)


def test_fused_lowering_refuses_int8_experts_and_names_the_key(tiny_models, tmp_path):
    recipe = write_recipe(tmp_path, tiny_models["qwen3_moe"], "ngram", graph="fused")
    with pytest.raises(RecipeError) as err:
        make_plan(load_recipe(recipe, ["onnxruntime.target_weights=int8"]))
    assert "onnxruntime.target_weights" in str(err.value) and "float32" in str(err.value)


@pytest.mark.parametrize("form", ["draft-vocab-subset", "float16-weights"])
def test_moe_kernel_graph_keeps_a_vocab_subset_and_float16_weights_of_the_export(
        form, tiny_models, tmp_path):
    """The rebuild reads what the export holds: a draft's vocabulary subset (its head rows and
    the spread back over the vocabulary) and float16 weights Cast where they are used. Its logits
    equal the exported graph's on the same calls (that graph is checked against transformers in
    test_export.py)."""
    path = tiny_models["gpt_oss"]
    subset = np.arange(4, 200, 3) if form == "draft-vocab-subset" else None
    res = export_model(resolve(str(path)), "draft" if subset is not None else "target",
                       tmp_path / "export", vocab_subset=subset,
                       weight_dtype="float16" if subset is None else "float32")
    work = tmp_path / "ort"
    work.mkdir()
    os.link(res.onnx_path.parent / DATA_FILE, work / DATA_FILE)
    rebuilt = rebuild_with_moe_op(res.onnx_path.parent, work, res.arch)
    tokens = np.random.default_rng(4).integers(4, 256, (2, 20))
    ours, theirs = (run_mixed_batch(GraphDriver(g, 2, ctx_len=32), tokens, [14, 10], 3)
                    for g in (rebuilt, res.onnx_path))
    for step in ours:
        assert np.abs(ours[step] - theirs[step]).max() <= TOL, step
    if subset is not None:  # tokens outside the subset are masked in both
        assert (ours["decode"] < -1e3).sum() == 2 * (256 - len(subset))
    assert ops(rebuilt)["MoE"] == 2

"""The fused ONNX Runtime lowering (backends/onnxruntime/ort_graph.py) of Gemma 3, Gemma 2 and
sliding windows shorter than the context: GroupQueryAttention's local_window_size, softcap and a
second RoPE base, Gemma's (1 + w) and sandwich norms and FastGelu, checked against
transformers' float32 forward on the tiny checkpoints (tests/conftest.py: windows of 5-6,
contexts of 19 tokens and more), and greedy n-gram speculative decoding through a fused bundle
equal to `generate`, also under continuous batching; a graph built for another reading of
local_window_size is refused where it is loaded.
Gemma 3 270M on its real weights: tests/test_gemma3.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from qpcbuild.backends.onnxruntime.ort_graph import PortableWeights, build_ort_graph
from qpcbuild.backends.onnxruntime.window import READING, keys_kept, local_window_size, reading
from qpcbuild.errors import BundleError
from qpcbuild.export import export_model
from qpcbuild.models.source import resolve
from qpcbuild.runtime.loader import load

from helpers_export import GraphDriver, hf_logits, prefill
from helpers_families import NEW_TOKENS, hf_greedy, prompts, write_recipe
from helpers_qaic import build

TOL = 1e-4  # max |logit| difference, as for every exported graph (test_export.py)
CTX = 32
VARIANTS = ("gemma3", "gemma3_bf16", "gemma2", "mistral_sliding", "mixtral")


def fused_graph(model: Path, root: Path) -> tuple[Path, object]:
    """The target's fused ORT graph of `model` at ctx_len CTX, batch 1, as the backend makes it."""
    res = export_model(resolve(str(model)), "target", root / "export")
    path = build_ort_graph(res.arch, PortableWeights(res.onnx_path), "target", 1, CTX,
                           root / "ort", {})
    return path, res.arch


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_graph_matches_transformers_past_the_sliding_window(variant, tiny_models,
                                                                  tmp_path):
    """Prefill in chunks of 8 (the last padded), a decode step, a rejected verify window and the
    K+1 window written over it, then one more decode: every context is longer than the window,
    so the sliding layers hide keys; each logit row within TOL of transformers'."""
    path = tiny_models[variant]
    graph, arch = fused_graph(path, tmp_path)
    nodes = onnx.load(str(graph), load_external_data=False).graph.node
    gqa = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
           for n in nodes if n.op_type == "GroupQueryAttention"]
    sliding = [i for i in range(arch.num_layers) if arch.is_sliding(i)]
    assert sliding and [i for i, a in enumerate(gqa) if "local_window_size" in a] == sliding
    assert all(gqa[i]["local_window_size"] == local_window_size(arch.sliding_window)
               for i in sliding)
    if variant == "gemma2":  # the score soft-cap is the kernel's (50 by default)
        assert all(a["softcap"] == pytest.approx(50.0) for a in gqa)
    if variant.startswith("gemma"):
        assert Counter(n.op_type for n in nodes)["FastGelu"] == arch.num_layers
    tokens = np.random.default_rng(len(variant)).integers(4, 256, 26).tolist()
    ref = hf_logits(path, tokens)
    drv = GraphDriver(graph, 1, CTX)
    worst = {"prefill": np.abs(prefill(drv, tokens[:19], 8)[0, -1] - ref[18]).max()}
    worst["decode"] = np.abs(drv([[tokens[19]]], [[19]])[0, -1] - ref[19]).max()
    window = [list(range(20, 24))]
    drv([[(t * 7 + 11) % 256 for t in tokens[20:24]]], window, nlk=4)  # rejected
    worst["verify"] = np.abs(drv([tokens[20:24]], window, nlk=4)[0] - ref[20:24]).max()
    worst["decode after"] = np.abs(drv([[tokens[24]]], [[24]])[0, -1] - ref[24]).max()
    assert max(worst.values()) <= TOL, (variant, worst)


@pytest.mark.parametrize("variant", ("gemma3", "gemma2"))
def test_fused_gemma_bundle_greedy_speculation_equals_generate(variant, tiny_models, tmp_path):
    """Through the runtime (in-place KV, the K=0 and K=3 kernels): n-gram speculation on the
    fused graph gives transformers' greedy tokens, prompts longer than the window."""
    target = tiny_models[variant]
    out = tmp_path / "bundle"
    build(write_recipe(tmp_path, target, "ngram", graph="fused"), tmp_path / "cache", out)
    gen = load(out)
    assert gen.manifest.target.backends["onnxruntime"].graph == "fused"
    accepted = 0
    for ids in prompts(len(variant)):
        result = gen.generate([ids], max_new_tokens=NEW_TOKENS).rows[0]
        assert result.tokens[len(ids):] == hf_greedy(target, ids), (variant, ids)
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("window", [1, 3, 5])
def test_local_window_size_for_a_window_keeps_that_many_keys(window):
    """Whatever the installed kernel reads local_window_size as, the attribute chosen for a
    window keeps exactly `window` keys for a query with more keys behind it."""
    assert keys_kept(local_window_size(window)) == window


def test_fused_gemma3_under_continuous_batching_equals_generate_for_every_request(
        tiny_models, tmp_path):
    """Four requests through 2 KV slots of a fused Gemma 3 bundle (windows row by row,
    single-token calls over both rows at once, each row's window from its own length): every
    request gets transformers' greedy tokens."""
    target = tiny_models["gemma3"]
    out = tmp_path / "bundle"
    build(write_recipe(tmp_path, target, "ngram", graph="fused"), tmp_path / "cache", out,
          "shapes.full_batch_size=2")
    gen = load(out)
    assert gen.decoder.cb and gen.target.batch_size == 2
    batch = prompts(3) + prompts(4)
    rows = gen.generate(batch, max_new_tokens=NEW_TOKENS).rows
    for ids, row in zip(batch, rows):
        assert row.tokens[len(ids):] == hf_greedy(target, ids), ids


def test_a_windowed_fused_graph_built_for_another_kernel_reading_is_refused_at_load(
        tiny_models, tmp_path):
    """A bundle whose graph records that its kernel kept a different number of keys for
    local_window_size (built under another onnxruntime) would attend to other keys here: load
    refuses it and says how to fix it, instead of running a wrong window."""
    out = tmp_path / "bundle"
    build(write_recipe(tmp_path, tiny_models["gemma3"], "ngram", graph="fused"),
          tmp_path / "cache", out)
    graph = out / "target" / "ort" / "model.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    recorded = {p.key: p for p in model.metadata_props}[READING]
    assert recorded.value == reading()[READING]
    recorded.value = str(1 - int(recorded.value))  # the other reading
    graph.write_bytes(model.SerializeToString())
    with pytest.raises(BundleError, match="local_window_size.*Rebuild"):
        load(out, verify="none")

"""Gemma 3 270M (`make gemma3`) on its real weights, past its 512-token sliding window: the
exported graph and its fused ONNX Runtime lowering against transformers' forward, and greedy
speculative decoding (n-gram and suffix proposals, recipes/gemma3-270m*.yaml, on the fused
graph) equal to transformers' `generate`, on prompts longer than
the window so five of every six layers attend to part of the context only.

Skipped when the model is not fetched; failed instead when QPCBUILD_REAL_MODEL=required (CI).
"""

from __future__ import annotations

import gc
import inspect
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qpcbuild.backends.onnxruntime.ort_graph import PortableWeights, build_ort_graph
from qpcbuild.cli import app
from qpcbuild.export import export_model
from qpcbuild.models.source import resolve
from qpcbuild.runtime.loader import load

from helpers_export import GraphDriver, hf_model, prefill

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


@pytest.fixture(scope="module", autouse=True)
def free_transformers_model():
    """transformers' float32 Gemma (1 GB) stays cached for this module only."""
    yield
    hf_model.cache_clear()
    gc.collect()
ROOT = Path(__file__).resolve().parents[1]
WINDOW = 512
NEW_TOKENS = 24  # each Gemma step is ~0.1-0.3 s here: two recipes stay near two minutes


def long_prompts(tok) -> dict[str, list[int]]:
    """A prompt of 600 tokens (BOS included) of Python source, where n-gram and suffix proposals
    find matches. One prompt: each costs this machine about a minute per recipe."""
    code = source_tokens(tok)[:600]
    assert len(code) > WINDOW
    return {"code": code}


def source_tokens(tok) -> list[int]:
    return tok(inspect.getsource(textwrap))["input_ids"]  # about 4,500 tokens


def tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def hf_last_logits(path: Path, tokens: list[int], keep: int) -> np.ndarray:
    """transformers' float32 logits of the last `keep` positions only ([keep, V]: the whole
    [S, 262144] matrix would be 0.6 GB)."""
    with torch.no_grad():
        out = hf_model(path)(torch.tensor([tokens]), logits_to_keep=keep)
    return out.logits[0].numpy()


def test_exported_and_fused_graphs_match_transformers_past_the_sliding_window(gemma3_model, tmp_path):
    try:
        _check_fidelity(gemma3_model, tmp_path)
    finally:  # 1.4 GB of weights: not kept in pytest's retained temporary folders
        shutil.rmtree(tmp_path / "onnx", ignore_errors=True)


def _check_fidelity(gemma3_model: Path, tmp_path: Path) -> None:
    """The exported (portable) graph, and the fused ONNX Runtime lowering built from it
    (GroupQueryAttention's local window over 512 of the 1,024 slots, two RoPE bases)."""
    result = export_model(resolve(str(gemma3_model)), "target", tmp_path / "onnx")
    tokens = source_tokens(tokenizer(gemma3_model))[:606]
    ref = hf_last_logits(gemma3_model, tokens, 7)  # positions 599..605
    fused = build_ort_graph(result.arch, PortableWeights(result.onnx_path), "target", 1, 1024,
                            tmp_path / "onnx" / "fused", {})
    for form, graph in (("exported", result.onnx_path), ("fused", fused)):
        _compare(GraphDriver(graph, 1, 1024), tokens, ref, form)


def _compare(drv: GraphDriver, tokens: list[int], ref: np.ndarray, form: str) -> None:
    worst = {"prefill": float(np.max(np.abs(prefill(drv, tokens[:600], 64)[0, -1] - ref[0])))}
    decode = drv(np.array([[tokens[600]]]), np.array([[600]]))
    worst["decode"] = float(np.max(np.abs(decode[0, -1] - ref[1])))
    window = np.arange(601, 606)
    drv(np.array([[(t * 7 + 11) % 262144 for t in tokens[601:606]]]), np.array([window]), nlk=5)
    verify = drv(np.array([tokens[601:606]]), np.array([window]), nlk=5)  # over the rejected one
    worst["verify"] = float(np.max(np.abs(verify[0] - ref[2:])))
    assert (verify[0].argmax(-1) == ref[2:].argmax(-1)).all()
    print(form, "max abs logit difference:", worst)
    assert max(worst.values()) < 2e-3, (form, worst)


@pytest.fixture(scope="module")
def reference(gemma3_model) -> dict[str, tuple[list[int], list[int]]]:
    """(prompt, transformers' greedy continuation) per prompt kind."""
    tok = tokenizer(gemma3_model)
    model = hf_model(gemma3_model)
    out = {}
    for kind, ids in long_prompts(tok).items():
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        out[kind] = (ids, gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def bundles_root(tmp_path_factory):
    """Where both recipes build (sharing one cache: one export), removed afterwards (~5 GB)."""
    root = tmp_path_factory.mktemp("gemma3-bundles")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("recipe", ["gemma3-270m", "gemma3-270m-suffix"])
def test_greedy_speculative_decoding_past_the_window_equals_generate(recipe, reference,
                                                                     bundles_root):
    root = bundles_root
    out = root / recipe
    built = CliRunner().invoke(app, ["compile", str(ROOT / "recipes" / f"{recipe}.yaml"), "-o",
                                     str(out), "--cache-dir", str(root / "cache")])
    assert built.exit_code == 0, built.output
    gen = load(out)
    accepted = 0
    for kind, (ids, expected) in reference.items():
        result = gen.generate([ids], max_new_tokens=NEW_TOKENS)
        assert result.rows[0].tokens[len(ids):] == expected, (recipe, kind)
        accepted += result.rows[0].stats.num_accepted_tokens
    print(recipe, "accepted draft tokens:", accepted)
    assert accepted > 0  # the proposals were verified, not skipped
    del gen
    gc.collect()

"""A draft with a vocabulary subset (draft.vocab_subset): its LM head keeps only the listed rows,
and its logits over the whole vocabulary equal the full head's on those tokens and are masked
elsewhere, in the card graph and in both ONNX Runtime lowerings. Output equality with
transformers and the sampling distribution are tested in test_oracles.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import qpcbuild
from qpcbuild.cli import app
from qpcbuild.export import export_model
from qpcbuild.export.decoder import MASKED
from qpcbuild.models.source import resolve

from helpers_export import GraphDriver

REPO = Path(__file__).resolve().parents[1]
DRAFT = REPO / "models" / "demo" / "draft"
VOCAB = json.loads((DRAFT / "config.json").read_text())["vocab_size"]
EOS = 0  # the demo pair's eos_token_id
runner = CliRunner()
PROMPT = [5, 17, 301, 42, 9, 1000, 77]


def subset_file(folder: Path, ids) -> Path:
    path = folder / "subset.json"
    path.write_text(json.dumps({"token_ids": [int(i) for i in ids]}))
    return path


def demo_recipe(folder: Path, subset: Path | None, graph: str = "fused",
                weights: str = "float32") -> Path:
    text = (REPO / "recipes" / "demo.yaml").read_text().replace("../models", str(REPO / "models"))
    if subset is not None:
        text = text.replace(f"model: {DRAFT}", f"model: {DRAFT}\n  vocab_subset: {subset.name}")
    text += f"onnxruntime: {{graph: {graph}, draft_weights: {weights}}}\n"
    path = folder / "r.yaml"
    path.write_text(text.replace("output: build/demo", f"output: {folder / 'b'}"))
    return path


def compile_(recipe: Path, cache: Path) -> Path:
    result = runner.invoke(app, ["compile", str(recipe), "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.output
    return recipe.parent / "b"


def draft_logits(bundle: Path) -> np.ndarray:
    """The bundle's own draft session over PROMPT, token by token: [len(PROMPT), V]."""
    draft = qpcbuild.load(bundle).decoder.draft
    return np.stack([draft.run(np.array([[t]]), np.array([[i]]))[0, 0].copy()
                     for i, t in enumerate(PROMPT)])


def check_spread(full: np.ndarray, sub: np.ndarray, ids: np.ndarray, atol: float) -> None:
    outside = np.setdiff1d(np.arange(VOCAB), ids)
    np.testing.assert_allclose(sub[:, ids], full[:, ids], atol=atol, rtol=0)
    assert np.all(sub[:, outside] == np.float32(MASKED))
    assert full[:, outside].max() > MASKED / 100  # the full head really has other logits


@pytest.fixture(scope="module")
def ids() -> np.ndarray:
    rng = np.random.default_rng(3)
    picked = rng.choice(np.arange(1, VOCAB), size=VOCAB // 3, replace=False)
    return np.unique(np.append(picked, EOS))  # the EOS is always kept (the plan adds it)


def test_card_graph_spreads_the_subset_logits_over_the_vocabulary(ids, tmp_path):
    src = resolve(str(DRAFT), None)
    full = export_model(src, "draft", tmp_path / "full")
    sub = export_model(src, "draft", tmp_path / "sub", vocab_subset=ids)
    assert sub.metadata["vocab_subset"] and "vocab_subset" not in full.metadata
    assert sub.weights_digest != full.weights_digest  # the index map is part of the graph
    run_full, run_sub = (GraphDriver(r.onnx_path, 1, 128) for r in (full, sub))
    got = [np.stack([d([[t]], [[i]])[0, 0] for i, t in enumerate(PROMPT)])
           for d in (run_full, run_sub)]
    check_spread(got[0], got[1], ids, atol=1e-5)
    data = [(tmp_path / d / "model.onnx.data").stat().st_size for d in ("full", "sub")]
    head = VOCAB * json.loads((DRAFT / "config.json").read_text())["hidden_size"] * 4
    assert data[0] - data[1] > 0.6 * head * (1 - len(ids) / VOCAB)  # the head really shrank


@pytest.mark.parametrize("graph,weights", [("fused", "float32"), ("fused", "int8"),
                                           ("portable", "float32")])
def test_onnxruntime_lowerings_spread_the_subset_logits(graph, weights, ids, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "sub").mkdir()
    full = compile_(demo_recipe(tmp_path / "full", None, graph, weights), tmp_path / "cache")
    sub = compile_(demo_recipe(tmp_path / "sub", subset_file(tmp_path / "sub", ids), graph,
                               weights), tmp_path / "cache")
    # int8: the subset's columns are quantized exactly as the full head's are
    check_spread(draft_logits(full), draft_logits(sub), ids, atol=1e-4)
    manifest = json.loads((sub / "manifest.json").read_text())
    assert manifest["roles"]["draft"]["vocab_subset"]["size"] == len(ids)
    assert "vocab_subset" not in json.loads((full / "manifest.json").read_text())["roles"]["draft"]


def test_bundle_id_follows_the_subset_content_not_its_path(ids, tmp_path):
    built = {}
    for name, subset in (("a", ids), ("b", ids), ("c", ids[:-1])):
        folder = tmp_path / name
        folder.mkdir()
        bundle = compile_(demo_recipe(folder, subset_file(folder, subset)), tmp_path / name / "c")
        built[name] = json.loads((bundle / "manifest.json").read_text())
    ident = {k: v["roles"]["draft"]["source"]["weights_digest"] for k, v in built.items()}
    assert ident["a"] == ident["b"] != ident["c"]
    assert all(v["roles"]["draft"]["vocab_subset"]["ref"] == "subset.json" for v in built.values())


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("{not json", "not a readable JSON file"),
    ('{"ids": [1, 2]}', "non-empty list 'token_ids'"),
    ('{"token_ids": []}', "non-empty list 'token_ids'"),
    ('{"token_ids": [1, 2, 99999]}', "token id 99999 is not an integer in 0..4095"),
    ('{"token_ids": [1, true]}', "token id True is not an integer"),
    ('{"token_ids": [1, 2, 2]}', "holds duplicates"),
    (json.dumps({"token_ids": list(range(VOCAB))}), "keeps every token"),
])
def test_bad_subset_files_are_named_with_the_key(content, message, tmp_path):
    path = tmp_path / "subset.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(app, ["plan", str(demo_recipe(tmp_path, path))])
    assert result.exit_code == 2, result.output
    assert "draft.vocab_subset" in result.output and message in result.output
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("ref,message", [("~nosuchuser/s.json", "not a usable path"),
                                         ("x" * 300 + ".json", "not a readable JSON file")])
def test_unusable_subset_paths_are_named_with_the_key(ref, message, tmp_path):
    recipe = demo_recipe(tmp_path, tmp_path / "subset.json")
    recipe.write_text(recipe.read_text().replace("vocab_subset: subset.json",
                                                 f"vocab_subset: {ref}"))
    result = runner.invoke(app, ["plan", str(recipe)])
    assert result.exit_code == 2, result.output
    assert "draft.vocab_subset" in result.output and message in result.output


def test_a_subset_needs_a_draft_model(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"schema: 1\nname: x\ntarget: {{model: {REPO / 'models/demo/target'}}}\n"
                      "draft: {method: ngram, vocab_subset: s.json}\n")
    result = runner.invoke(app, ["plan", str(recipe)])
    assert result.exit_code == 2 and "draft.vocab_subset" in result.output
    assert "uses no draft model" in result.output

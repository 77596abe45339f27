"""The real pair: SmolLM2-135M-Instruct (`make smollm2`) and the draft this project trained for it.

Oracles are transformers' own: its forward pass for the exported graph, its `generate` for greedy
speculative decoding, its `apply_chat_template` for chat prompts. Skipped when the model is not on
this machine, failed instead when QPCBUILD_REAL_MODEL=required (as .ci/run sets it).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qpcbuild.bundle import read_manifest
from qpcbuild.cli import app
from qpcbuild.export import export_model
from qpcbuild.runtime.loader import load
from qpcbuild.models.source import resolve

from helpers_export import GraphDriver, hf_logits, prefill, run_mixed_batch

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
NEW_TOKENS = 40
# Prompts the draft never saw in training (its data: stdlib function openings, its own questions).
HELD_OUT = {
    "code": json.loads((ROOT / "qpcbuild/data/prompts/code.jsonl").read_text()
                       .splitlines()[0])["prompt"],
    "prose": json.loads((ROOT / "qpcbuild/data/prompts/prose.jsonl").read_text()
                        .splitlines()[0])["prompt"],
}
CHAT = "List three uses of a hash map."


@lru_cache(maxsize=None)
def hf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_generate(path: Path, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    model, tok = hf(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def bundles(real_pair, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real")
    out = {}
    for recipe in ("smollm2", "smollm2-ngram", "smollm2-suffix", "smollm2-disagg"):
        out[recipe] = root / recipe
        built = runner.invoke(app, ["compile", str(ROOT / "recipes" / f"{recipe}.yaml"), "-o",
                                    str(out[recipe]), "--cache-dir", str(root / "cache")])
        assert built.exit_code == 0, built.output
    return out


def test_exported_target_matches_transformers_forward(real_pair, tmp_path):
    target, _ = real_pair
    result = export_model(resolve(str(target)), "target", tmp_path / "onnx")
    _, tok = hf(target)
    tokens = tok(HELD_OUT["code"] + HELD_OUT["prose"])["input_ids"][:90]
    ref = hf_logits(target, tokens)
    drv = GraphDriver(result.onnx_path, 1, 256)
    got = prefill(drv, tokens[:80], 32)
    worst = float(np.max(np.abs(got[0, -1] - ref[79])))
    decode = drv(np.array([[tokens[80]]]), np.array([[80]]))
    worst = max(worst, float(np.max(np.abs(decode[0, -1] - ref[80]))))
    verify = drv(np.array([tokens[81:86]]), np.array([list(range(81, 86))]), nlk=5)
    worst = max(worst, float(np.max(np.abs(verify[0] - ref[81:86]))))
    assert worst < 2e-3, f"max abs logit difference {worst:.3g} over prefill/decode/verify"


def test_exported_target_handles_pads_and_two_rows(real_pair, tmp_path):
    target, _ = real_pair
    result = export_model(resolve(str(target)), "target", tmp_path / "onnx")
    _, tok = hf(target)
    code = tok(HELD_OUT["code"])["input_ids"]
    tokens = np.array([code[:20], code[20:40]])
    lengths = [12, 10]  # prompt lengths inside the rows; the rest is decoded and verified
    drv = GraphDriver(result.onnx_path, 2, 64)
    steps = run_mixed_batch(drv, tokens, lengths, k=3)
    for r, n in enumerate(lengths):
        ref = hf_logits(target, tokens[r, :n + 5])
        assert np.max(np.abs(steps["chunk2"][r, -1] - ref[n - 1])) < 2e-3
        assert np.max(np.abs(steps["decode"][r, -1] - ref[n])) < 2e-3
        assert np.max(np.abs(steps["verify"][r] - ref[n + 1:n + 5])) < 2e-3


@pytest.mark.parametrize("recipe", ["smollm2", "smollm2-ngram", "smollm2-suffix"])
def test_greedy_speculative_decoding_equals_transformers_generate(recipe, bundles, real_pair):
    target, _ = real_pair
    gen = load(bundles[recipe])
    for kind, text in HELD_OUT.items():
        ids = gen.encode(text)
        ours = gen.generate([ids], max_new_tokens=NEW_TOKENS).rows[0]
        assert ours.tokens[len(ids):] == hf_generate(target, ids), (recipe, kind)
    ids = gen.chat_prompt(CHAT)
    ours = gen.generate([CHAT], max_new_tokens=NEW_TOKENS, chat=True).rows[0]
    assert ours.tokens[len(ids):] == hf_generate(target, ids), (recipe, "chat")


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_disaggregated_bundle_equals_the_aggregated_one_and_transformers(method, bundles,
                                                                          real_pair):
    """The prompt's KV crosses from the prefill process to this one (the decode node), which
    speculates; a prompt longer than prefill_seq_len (64) is prefilled in chunks there."""
    target, _ = real_pair
    disagg = load(bundles["smollm2-disagg"], method=method)
    aggregated = load(bundles["smollm2"], method=method)
    long_prompt = HELD_OUT["prose"] + "\n\n" + HELD_OUT["code"]
    for text in (HELD_OUT["code"], long_prompt):
        ids = disagg.encode(text)
        ours = disagg.generate([ids], max_new_tokens=NEW_TOKENS)
        new = ours.rows[0].tokens[len(ids):]
        assert new == hf_generate(target, ids), (method, len(ids))
        assert new == aggregated.generate([ids], max_new_tokens=NEW_TOKENS).rows[0] \
            .tokens[len(ids):]
        handoff = ours.handoff
        assert handoff is not None and handoff["processes"] == 2
        # every layer's key and value, [1, 3 kv heads, n - 1, 64] float32 each
        assert handoff["bytes"] == 30 * 2 * 3 * (len(ids) - 1) * 64 * 4
    assert len(disagg.encode(long_prompt)) > 64
    assert disagg.prefill_worker.proc.pid != __import__("os").getpid()


def test_draft_and_target_tokenizers_are_identical(bundles):
    m = read_manifest(bundles["smollm2"]).to_json_dict()
    assert m["tokenizer"]["verdict"] == "identical"
    assert m["roles"]["draft"]["backends"]["onnxruntime"]["weights"] == "int8"


def test_chat_prompt_equals_transformers_apply_chat_template(bundles, real_pair):
    target, _ = real_pair
    _, tok = hf(target)
    gen = load(bundles["smollm2-ngram"])
    conversations = [[{"role": "user", "content": CHAT}],
                     [{"role": "system", "content": "Answer in one line."},
                      {"role": "user", "content": "What is 2+2?"},
                      {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "And 3+3?"}]]
    for messages in conversations:
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert gen.chat_prompt(messages) == list(want)
    with_system = gen.chat_prompt(CHAT, system="Be brief.")
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": CHAT}],
                                   add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert with_system == list(want)


def test_run_chat_from_the_command_line(bundles):
    ran = runner.invoke(app, ["run", str(bundles["smollm2"]), "--chat", "--prompt", CHAT,
                              "--max-new-tokens", "16", "--json"])
    assert ran.exit_code == 0, ran.output
    report = json.loads(ran.stdout)
    assert report["batches"][0]["outputs"][0]["text"].strip()

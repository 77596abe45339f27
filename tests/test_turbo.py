"""Turbo draft heads (draft.method: turbo): the head folder is read strictly and refused with the
reason when it does not fit the target; the heads compiled into the target's graph give the
logits that transformers' own hidden states give through the same heads; greedy output equals
transformers' `generate`. Sampling at T > 0 and the demo pair's batch and continuous-batching
cases are in test_oracles.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import qpcbuild
from qpcbuild.cli import app
from qpcbuild.errors import UsageError
from qpcbuild.models.turbo_heads import read_turbo_heads
from qpcbuild.runtime.rows import new_row
from qpcbuild.runtime.sampling import SamplingParams
from qpcbuild.testing import write_random_turbo_heads

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, intermediate_size=128, max_position_embeddings=512)


def recipe(folder: Path, target: Path, heads: Path, k: int = 3, extra: str = "") -> Path:
    path = folder / "turbo.yaml"
    path.write_text(f"""schema: 1
name: turbo-test
target: {{model: {target}}}
draft: {{method: turbo, model: {heads}}}
speculation: {{num_speculative_tokens: {k}}}
shapes: {{batch_size: 1, prefill_seq_len: 8, ctx_len: 64}}
backends: [onnxruntime]
{extra}""")
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama (weights large enough that logits are O(1)) with a word tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("turbo_tiny")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model.save_pretrained(root / "target", safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY["vocab_size"])},
                                     unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "target" / "tokenizer.json"))
    return root / "target"


# ---------------------------------------------------------------- the format, strictly
def _drop(key):
    return lambda t, c: t.pop(key)


def _extra(t, c):
    t["projections.3.0.linear.weight"] = t["projections.0.0.linear.weight"]


def _unshared(t, c):
    t["projections.1.1.linear.weight"] = t["projections.1.1.linear.weight"] + 1.0


def _bad_count(t, c):
    c["turbo_num_heads"] = 0


@pytest.mark.parametrize("tamper,message", [
    (_drop("projections.2.1.linear.bias"), "missing projections.2.1.linear.bias"),
    (_extra, "unexpected projections.3.0.linear.weight"),
    (_unshared, "head 1's layers differ"),
    (_bad_count, "turbo_num_heads must be a whole number"),
], ids=["missing", "extra", "unshared", "bad-config"])
def test_head_folders_are_read_strictly(tamper, message, tmp_path):
    folder = write_random_turbo_heads(tmp_path / "h", 16, tamper=tamper)
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        read_turbo_heads(folder, 16)


def test_heads_of_another_hidden_size_are_refused(tmp_path):
    with pytest.raises(UsageError, match=r"has shape \[16, 16\].*hidden size 32"):
        read_turbo_heads(write_random_turbo_heads(tmp_path / "h", 16), 32)


def test_a_good_folder_reads_one_copy_per_head(tmp_path):
    heads = read_turbo_heads(write_random_turbo_heads(tmp_path / "h", 16, heads=2, layers=3), 16)
    assert (heads.info.num_heads, heads.info.num_layers) == (2, 3)
    assert [w.shape for w in heads.weights] == [(16, 16)] * 2


# ---------------------------------------------------------------- the recipe
@pytest.mark.parametrize("case", ["hidden", "k", "missing"])
def test_a_recipe_with_unfit_heads_exits_2_naming_the_reason(case, tiny_llama, tmp_path):
    heads = write_random_turbo_heads(tmp_path / "h", 32 if case == "hidden" else 64)
    if case == "missing":
        heads = tmp_path / "nowhere"
    path = recipe(tmp_path, tiny_llama, heads, k=5 if case == "k" else 3)
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2, result.output
    assert "draft.model" in result.output or "num_speculative_tokens" in result.output
    expected = {"hidden": "hidden size 64", "k": "K=5 exceeds the 3 turbo heads",
                "missing": "not a folder"}[case]
    assert expected in " ".join(result.output.split()), result.output


def test_turbo_options_of_other_methods_are_refused(tiny_llama, tmp_path):
    path = recipe(tmp_path, tiny_llama, write_random_turbo_heads(tmp_path / "h", 64))
    path.write_text(path.read_text().replace("method: turbo,", "method: turbo, "
                                             "vocab_subset: x.json,"))
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2 and "draft.vocab_subset" in result.output, result.output


# ---------------------------------------------------------------- the graph and the loop
def torch_head_logits(model, ids: list[int], heads_dir: Path) -> np.ndarray:
    """[heads, V] at the last of `ids`: transformers' final hidden state through the heads
    (y + SiLU(y W^T + b), `turbo_num_layers` times, read with safetensors' own loader) and the
    model's LM head."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file

    cfg = json.loads((heads_dir / "speculator_config.json").read_text())
    weights = load_file(str(heads_dir / "speculator.safetensors"))
    with torch.no_grad():
        x = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        out = []
        for h in range(cfg["turbo_num_heads"]):
            y = x
            for n in range(cfg["turbo_num_layers"]):
                y = y + F.silu(F.linear(y, weights[f"projections.{h}.{n}.linear.weight"],
                                        weights[f"projections.{h}.{n}.linear.bias"]))
            out.append(model.lm_head(y))
    return torch.stack(out).numpy()


@pytest.mark.parametrize("graph", ["fused", "portable"])
def test_turbo_output_equals_generate_and_heads_match_transformers(graph, tiny_llama, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    heads_dir = write_random_turbo_heads(tmp_path / "h", 64, scale=0.5)
    path = recipe(tmp_path, tiny_llama, heads_dir, extra=f"onnxruntime: {{graph: {graph}}}\n")
    result = runner.invoke(app, ["compile", str(path), "-o", str(tmp_path / "b"),
                                 "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 0, result.output
    served = runner.invoke(app, ["serve-config", str(tmp_path / "b")])
    assert served.exit_code == 2 and "does not serve draft heads" in served.output
    gen = qpcbuild.load(tmp_path / "b")
    assert gen.manifest.roles["target"].io.outputs[0].shape[2] == 4  # base + 3 heads
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    kept = []  # (tokens so far, the heads' logits the row keeps for its next proposal)
    for prompt in ([3, 17, 42, 9, 100], [7] * 11 + [200, 5]):
        row = new_row(prompt, 24, gen.decoder.ctx_len, SamplingParams(), 0)

        def seen(index: int, new: list[int], row=row) -> None:
            if new and not row.done:
                kept.append((list(row.tokens), row.head_logits.copy()))

        gen.decoder.run_rows([row], on_token=seen)
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert row.tokens == ref[0].tolist()
        assert row.stats.num_drafts > 0
    assert kept
    for tokens, logits in kept:  # the heads at the last accepted token: tokens[-2]
        np.testing.assert_allclose(logits, torch_head_logits(model, tokens[:-1], heads_dir),
                                   rtol=1e-4, atol=1e-4)


def test_bench_on_a_turbo_recipe_compiles_ks_up_to_the_head_count(tiny_llama, tmp_path):
    """A bench bundle built from a recipe compiles Ks 0..8; a turbo one stops at its heads
    (K=4 would be refused at plan time: no fourth head proposes)."""
    heads = write_random_turbo_heads(tmp_path / "h", TINY["hidden_size"], heads=3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w9 w3 w7 w5 w9"}) + "\n")
    report = tmp_path / "b.json"
    result = runner.invoke(app, ["bench", str(recipe(tmp_path, tiny_llama, heads)),
                                 "--bundle-dir", str(tmp_path / "bench-bundle"),
                                 "--cache-dir", str(tmp_path / "cache"), "--methods", "turbo",
                                 "--prompts", str(prompts), "--max-new-tokens", "6",
                                 "--repeats", "1", "--peers", "none", "--json-out", str(report)])
    assert result.exit_code == 0, result.output
    rows = json.loads(report.read_text())["rows"]
    assert [(r["method"], r["k"]) for r in rows] == \
        [("target_only", 0), ("turbo", 1), ("turbo", 2), ("turbo", 3)]

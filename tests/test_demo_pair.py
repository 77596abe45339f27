"""The shipped demo pair meets its quality bars: it loads with transformers and tokenizers, the
target predicts held-out standard-library code (loss <= 3.8 nats/token) and the draft agrees
with it often enough (>= 2.3 tokens per target call at K=4)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


@pytest.fixture(scope="module")
def training() -> dict:
    return json.loads((DEMO / "training.json").read_text())


def test_both_models_load_with_transformers_and_tokenizers():
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    for role in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(DEMO / role, dtype=torch.float32)
        tok = Tokenizer.from_file(str(DEMO / role / "tokenizer.json"))
        assert tok.get_vocab_size() == model.config.vocab_size == 4096
        assert model.config.architectures == ["LlamaForCausalLM"]
        assert (DEMO / role / "model.safetensors").stat().st_size < 12 * 2**20
        assert "Validation loss" in (DEMO / role / "README.md").read_text()
    t, d = (json.loads((DEMO / r / "config.json").read_text()) for r in ("target", "draft"))
    assert (t["hidden_size"], t["num_hidden_layers"]) == (256, 6)
    assert (d["hidden_size"], d["num_hidden_layers"]) == (128, 2)


@pytest.mark.slow  # a transformers forward over every held-out file: 3-60 s by machine load
def test_target_validation_loss_on_held_out_stdlib_code(training):
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / n for n in training["validation_file_names"]]
    if not all(f.is_file() for f in files):
        pytest.skip("this interpreter's standard library lacks the held-out files")
    tok = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for f in files:
        stream += tok.encode(f.read_text(encoding="utf-8", errors="replace")).ids + [eos]
    model = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for i in range(training["val_windows"]):  # the windows the model card reports (>= 64)
            chunk = torch.tensor(stream[i * 256:(i + 1) * 256 + 1])[None]
            assert chunk.shape[1] == 257, "held-out set too small"
            logits = model(input_ids=chunk[:, :-1]).logits
            losses.append(F.cross_entropy(logits[0], chunk[0, 1:]).item())
    loss = float(np.mean(losses))
    assert len(losses) >= 64
    assert loss <= 3.8, loss
    assert loss == pytest.approx(training["target_val_loss"], abs=0.05)


def test_draft_agreement_through_a_compiled_bundle(tmp_path_factory):
    """Greedy SpD at K=4 on the 20 held-out prompts, run by qpcbuild itself on ONNX Runtime."""
    import qpcbuild
    from qpcbuild.bundle import build_bundle
    from qpcbuild.cache import Cache
    from qpcbuild.plan import make_plan
    from qpcbuild.recipe import load_recipe

    out = tmp_path_factory.mktemp("demo") / "bundle"
    build_bundle(make_plan(load_recipe(ROOT / "recipes" / "demo.yaml")),
                 cache=Cache(tmp_path_factory.getbasetemp() / "cache"), out=out)
    gen = qpcbuild.load(out, k=4)
    prompts = [json.loads(line)["text"] for line in
               (DEMO / "eval_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) >= 20
    accepted = drafts = 0
    for p in prompts[:20]:
        st = gen.generate([p], max_new_tokens=64).stats
        accepted += st.num_accepted_tokens
        drafts += st.num_drafts
    tau = 1 + accepted / drafts
    assert tau >= 2.3, tau

"""What the family tests share (test_families.py, test_moe_ort.py): a recipe for a tiny
checkpoint, prompts that exercise the proposers, and transformers' own greedy output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from helpers_export import hf_model

NEW_TOKENS = 24


def write_recipe(folder: Path, target: Path, method: str, *, draft: Path | None = None,
                 graph: str = "portable", backends: str = "[onnxruntime]",
                 ctx_len: int = 64) -> Path:
    proposer = {"ngram": "method: ngram\n  prompt_lookup_min: 1\n  prompt_lookup_max: 3",
                "suffix": "method: suffix",
                "draft_model": f"method: draft_model\n  model: {draft}"}[method]
    draft_hw = "\n  draft: {device_group: [0], num_cores: 4}" if method == "draft_model" else ""
    path = folder / f"{target.name}-{method}.yaml"
    path.write_text(f"""\
schema: 1
name: {target.name}-{method}
target:
  model: {target}
draft:
  {proposer}
speculation:
  num_speculative_tokens: 3
shapes:
  batch_size: 1
  prefill_seq_len: 8
  ctx_len: {ctx_len}
hardware:
  card: cloud-ai-100-ultra
  target: {{device_group: [0], num_cores: 8}}{draft_hw}
backends: {backends}
onnxruntime: {{graph: {graph}}}
""")
    return path


def prompts(seed: int) -> list[list[int]]:
    """A prompt that repeats a phrase (so n-gram and suffix proposals get accepted) and one that
    does not; both avoid the tiny models' special ids 0-3."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(4, 256, 5).tolist()
    return [rng.integers(4, 256, 6).tolist() + phrase * 3, rng.integers(4, 256, 19).tolist()]


def hf_greedy(path: Path, ids: list[int]) -> list[int]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()

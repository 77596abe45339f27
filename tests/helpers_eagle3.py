"""What the EAGLE-3 tests share (test_eagle3.py, test_eagle3_card.py): the small head's sizes, an
independent PyTorch forward of a head from transformers' own Llama building blocks, and the demo
target's eagle3 recipe with a random head."""

from __future__ import annotations

from pathlib import Path

from qpcbuild.testing import write_random_eagle3_head

LAYERS, HIDDEN, VOCAB = 4, 32, 96
DEMO = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"


def torch_head(folder: Path, embed, ids, hidden):
    """(logits, hidden_out) of the head over one sequence from position 0, by transformers'
    LlamaRMSNorm / LlamaRotaryEmbedding / apply_rotary_pos_emb / LlamaMLP and the weights read
    with safetensors' own loader."""
    import json

    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)

    cfg = json.loads((folder / "config.json").read_text())
    lc = LlamaConfig(**{k: v for k, v in cfg["transformer_layer_config"].items()
                        if k != "model_type"})
    w = load_file(str(folder / "model.safetensors"))

    def norm(name):
        n = LlamaRMSNorm(lc.hidden_size, eps=lc.rms_norm_eps)
        n.weight.data.copy_(w[name])
        return n

    mlp = LlamaMLP(lc)
    for part in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, part).weight.data.copy_(w[f"layers.0.mlp.{part}.weight"])
    with torch.no_grad():
        x = torch.tensor(embed)[torch.tensor(ids)][None]
        h = torch.tensor(hidden)[None]
        z = torch.cat([norm("layers.0.input_layernorm.weight")(x),
                       norm("layers.0.hidden_norm.weight")(h)], -1)
        d, n = lc.head_dim, len(ids)
        q, k, v = (F.linear(z, w[f"layers.0.self_attn.{p}_proj.weight"]).view(1, n, -1, d)
                   .transpose(1, 2) for p in "qkv")
        cos, sin = LlamaRotaryEmbedding(lc)(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        attn = F.linear(attn.transpose(1, 2).reshape(1, n, -1), w["layers.0.self_attn.o_proj.weight"])
        y = h + attn
        out = y + mlp(norm("layers.0.post_attention_layernorm.weight")(y))
        logits = F.linear(norm("norm.weight")(out), w["lm_head.weight"])
    return logits[0].numpy(), out[0].numpy()


def recipe(folder: Path, head: Path, graph: str = "fused", extra: str = "") -> Path:
    path = folder / "eagle3.yaml"
    path.write_text(f"""schema: 1
name: eagle3-test
target: {{model: {DEMO}}}
draft: {{method: eagle3, model: {head}}}
speculation: {{num_speculative_tokens: 3}}
shapes: {{batch_size: 1, prefill_seq_len: 8, ctx_len: 64}}
backends: [onnxruntime]
onnxruntime: {{graph: {graph}}}
{extra}""")
    return path


def demo_head(folder: Path, heads: int = 4, kv_heads: int = 2, **kw) -> Path:
    import json

    cfg = json.loads((DEMO / "config.json").read_text())
    return write_random_eagle3_head(folder, cfg["num_hidden_layers"], cfg["hidden_size"],
                                    cfg["vocab_size"], heads=heads, kv_heads=kv_heads, **kw)

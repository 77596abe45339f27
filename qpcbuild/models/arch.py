"""Architecture facts read from a Hugging Face config.json.

Every supported family is one row of `FAMILIES`: what differs between Llama, Mistral, Qwen2,
Qwen3, Gemma 2, Gemma 3 and Granite is data (biases, q/k norms, (1 + w) norms, scaled
embeddings, the feed-forward norms around each block, the activation, soft-capping, multipliers,
sliding layers and their RoPE base), so the exporter has exactly one decoder.
"""
# The spec every row fills (its fields, tensor shapes, parameter counts and RoPE) is arch_spec.py;
# config.json's field readers are config_reader.py.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UsageError
from .arch_spec import ArchSpec
from .config_reader import FULL, LIMITS, ROPE_TYPES, SLIDING, ConfigReader, read_rope, rotary_dim_of

__all__ = ["ACTIVATIONS", "FAMILIES", "FULL", "LIMITS", "ROPE_TYPES", "SLIDING", "ArchSpec",
           "Family", "MoeNames", "arch_from_config"]


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    # Gemma: every RMSNorm scales by (1 + w), embeddings are multiplied by sqrt(hidden_size),
    # the attention and MLP outputs are normed before their residual add and the MLP input by a
    # norm of its own ("sandwich" norms), and scores are scaled by query_pre_attn_scalar.
    gemma: bool = False
    # transformers' defaults where config.json leaves a key out (Gemma 2: soft-capping on)
    default_attn_softcap: float | None = None
    default_final_softcap: float | None = None
    sliding_pattern: int | None = None  # every Nth layer full, the rest sliding (no layer_types)
    local_rope: bool = False  # sliding layers have a RoPE base of their own (Gemma 3)
    # Granite: Llama's block with four multipliers (embeddings, scores, each residual branch,
    # and a divisor of the logits)
    multipliers: bool = False
    # Phi-3: q/k/v in one qkv_proj and gate/up in one gate_up_proj (sliced after the MatMul)
    fused_projections: bool = False
    # Mixture of experts: the checkpoint's names for the block, its router and each expert's
    # gate / up / down projections; norm_topk: whether the top-k weights always sum to one
    moe: "MoeNames | None" = None
    # GPT-OSS: a learned "sink" logit per head joins each softmax; experts stored stacked
    # ([E, ...] tensors with biases), routed by a softmax over the top-k logits, with a clamped
    # SwiGLU
    attention_sinks: bool = False
    stacked_experts: bool = False


@dataclass(frozen=True)
class MoeNames:
    block: str  # model.layers.{i}.<block>
    gate: str
    up: str
    down: str
    always_norm_topk: bool  # Mixtral renormalizes; Qwen3-MoE as config's norm_topk_prob says


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True),
    "Gemma2ForCausalLM": Family("gemma2", gemma=True, default_attn_softcap=50.0,
                                default_final_softcap=30.0, sliding_pattern=2),
    "Gemma3ForCausalLM": Family("gemma3", qk_norm=True, gemma=True, sliding_pattern=6,
                                local_rope=True),
    "GraniteForCausalLM": Family("granite", multipliers=True),
    "Phi3ForCausalLM": Family("phi3", fused_projections=True),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm=True, moe=MoeNames(
        "mlp", "gate_proj", "up_proj", "down_proj", always_norm_topk=False)),
    "MixtralForCausalLM": Family("mixtral", moe=MoeNames(
        "block_sparse_moe", "w1", "w3", "w2", always_norm_topk=True)),
    "GptOssForCausalLM": Family("gpt_oss", moe=MoeNames(
        "mlp", "gate_up_proj", "gate_up_proj", "down_proj", always_norm_topk=False),
        attention_sinks=True, stacked_experts=True),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # gate activations of the gated MLP


def _experts(r: ConfigReader, fam: Family, layers: int | None) -> dict[str, Any]:
    """A mixture-of-experts family's routing facts; {} for a dense one."""
    if fam.moe is None:
        return {}
    config = r.config
    experts = r.int("num_local_experts" if "num_local_experts" in config else "num_experts")
    top_k = r.int("num_experts_per_tok")
    width = r.int("moe_intermediate_size") if "moe_intermediate_size" in config else \
        r.int("intermediate_size")
    step = r.int("decoder_sparse_step", 1)
    only_mlp = config.get("mlp_only_layers") or []
    if not isinstance(only_mlp, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                             for v in only_mlp):
        r.problems.append(f"mlp_only_layers: expected a list of layer numbers, got {only_mlp!r}")
        only_mlp = []
    if experts and top_k and top_k > experts:
        r.problems.append(f"num_experts_per_tok {top_k} exceeds the {experts} experts")
    norm = config.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        r.problems.append(f"norm_topk_prob: expected true or false, got {norm!r}")
    if not (experts and top_k and width and step and layers):
        return {}
    moe = fam.moe
    swiglu = {}
    if fam.stacked_experts:
        swiglu = {"swiglu_alpha": r.number("swiglu_alpha", config.get("swiglu_alpha", 1.702)),
                  "swiglu_limit": r.number("swiglu_limit", config.get("swiglu_limit", 7.0))}
    return {**swiglu, "num_experts": experts, "experts_per_token": top_k,
            "expert_intermediate_size": width, "norm_topk_prob": moe.always_norm_topk or norm,
            "moe_layers": tuple(i for i in range(layers)
                                if i not in only_mlp and (i + 1) % step == 0),
            "moe_names": (moe.block, moe.gate, moe.up, moe.down)}


def _layer_types(r: ConfigReader, fam: Family, layers: int | None,
                 window: int | None) -> tuple[str, ...]:
    """Each layer's attention kind: config.json's `layer_types`, else the family's pattern
    (Gemma), else every layer sliding when a window is set (Mistral)."""
    if not layers or not window:
        return ()
    given = r.config.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != layers or \
                any(t not in (SLIDING, FULL) for t in given):
            r.problems.append(f"layer_types: expected {layers} entries, each '{SLIDING}' or "
                              f"'{FULL}', got {given!r}")
            return ()
        return tuple(given)
    if fam.sliding_pattern:
        n = r.config.get("sliding_window_pattern", fam.sliding_pattern)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            r.problems.append(f"sliding_window_pattern: expected a positive integer, got {n!r}")
            return ()
        return tuple(SLIDING if (i + 1) % n else FULL for i in range(layers))
    return (SLIDING,) * layers


def _scales(r: ConfigReader, fam: Family, hidden: int | None) -> dict[str, Any]:
    """The numbers that scale a block: soft-capping (transformers' defaults where config.json
    leaves them out), Granite's multipliers, and Gemma's (1 + w) norms, sqrt(H) embeddings and
    query_pre_attn_scalar."""
    config, out = r.config, {}
    if config.get("use_bidirectional_attention"):
        r.problems.append("use_bidirectional_attention: true is an encoder's attention; only "
                          "causal decoders are supported")
    for key, default in (("attn_logit_softcapping", fam.default_attn_softcap),
                         ("final_logit_softcapping", fam.default_final_softcap)):
        value = config.get(key, default)
        out[key] = None if value is None else r.number(key, value)
    if fam.multipliers:  # Granite's four, each 1.0 where config.json leaves it out
        out.update(embedding_scale=r.number("embedding_multiplier",
                                            config.get("embedding_multiplier", 1.0)),
                   attention_scale=r.number("attention_multiplier",
                                            config.get("attention_multiplier", 1.0)),
                   residual_scale=r.number("residual_multiplier",
                                           config.get("residual_multiplier", 1.0)),
                   logits_divisor=r.number("logits_scaling", config.get("logits_scaling", 1.0)))
    if not fam.gemma:
        return out
    scalar = r.number("query_pre_attn_scalar", config.get("query_pre_attn_scalar", 256))
    out.update(norm_offset=1.0, sandwich_norms=True,
               # float32, as transformers holds it: a float32 buffer (the embedding's dtype here)
               embedding_scale=float(np.float32((hidden or 1) ** 0.5)),
               attention_scale=scalar ** -0.5 if scalar else None)
    return out


def arch_from_config(config: dict[str, Any], source: str = "config.json") -> ArchSpec:
    """Read and check the facts the exporter needs. Every problem is reported at once, each
    naming its key; unsupported models get a clear error."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None) if isinstance(archs, list) else None
    if arch is None:
        raise UsageError(f"{source}: architecture {archs or config.get('model_type')} is not "
                         f"supported; supported: {', '.join(sorted(FAMILIES))}")
    fam = FAMILIES[arch]
    r = ConfigReader(config)
    h = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    kv = r.int("num_key_value_heads", heads) or heads
    layers = r.int("num_hidden_layers")
    inter = r.int("intermediate_size")
    vocab = r.int("vocab_size")
    max_pos = r.int("max_position_embeddings", 2048)
    head_dim = r.int("head_dim", None, allow_none=True)
    if head_dim is None and h and heads:
        if h % heads:
            r.problems.append(f"hidden_size {h} is not a multiple of num_attention_heads {heads}"
                              " (and no head_dim is given)")
        head_dim = h // heads
    if head_dim and head_dim % 2:
        r.problems.append(f"head_dim: {head_dim} is odd; rotary embeddings need an even head_dim")
    if heads and kv and heads % kv:
        r.problems.append(f"num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv}")
    eps = r.number("rms_norm_eps", config.get("rms_norm_eps", 1e-6))
    # Qwen configs carry a window that is off unless use_sliding_window; Mistral's, Mixtral's
    # and Gemma's are on when set.
    window = r.int("sliding_window", None, allow_none=True)
    on_when_set = not fam.name.startswith("qwen")
    if config.get("use_sliding_window", on_when_set) is False:
        window = None
    (theta, scaling), local_rope = read_rope(r, fam.local_rope)
    rotary_dim = rotary_dim_of(r, head_dim, scaling)
    layer_types = _layer_types(r, fam, layers, window)
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        r.problems.append(f"hidden_act: '{act}' is not supported (supported: "
                          f"{', '.join(ACTIVATIONS)})")
    extra = {**_scales(r, fam, h), **_experts(r, fam, layers)}
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    bos = config.get("bos_token_id")
    for name, value in [("bos_token_id", bos)] + [("eos_token_id", e) for e in eos_ids]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0 or (vocab and value >= vocab)):
            r.problems.append(f"{name}: {value!r} is not a token id of the vocabulary")
    for flag in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        if not isinstance(config.get(flag, False), bool):
            r.problems.append(f"{flag}: expected true or false, got {config[flag]!r}")
    if r.problems:
        raise UsageError(f"{source}: " + "; ".join(r.problems))
    attention_bias = config.get("attention_bias", False)
    return ArchSpec(
        architecture=arch, family=fam.name, hidden_size=h, num_layers=layers, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
        rms_norm_eps=eps, rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=config.get("tie_word_embeddings", False),
        qkv_bias=fam.qkv_bias or attention_bias, o_bias=attention_bias and fam.name != "qwen2",
        mlp_bias=config.get("mlp_bias", False), qk_norm=fam.qk_norm,
        max_position_embeddings=max_pos,
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        bos_token_id=bos, eos_token_ids=eos_ids,
        sliding_window=window if SLIDING in layer_types else None, layer_types=layer_types,
        hidden_act=act, fused_projections=fam.fused_projections, rotary_dim=rotary_dim,
        attention_sinks=fam.attention_sinks, stacked_experts=fam.stacked_experts,
        local_rope_theta=local_rope[0] if local_rope else None,
        local_rope_scaling=local_rope[1] if local_rope else None, **extra,
    )

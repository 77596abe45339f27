"""Architecture facts read from a Hugging Face config.json.

Every supported family is one row of `FAMILIES`: what differs between Llama, Mistral, Qwen2,
Qwen3, Gemma 2, Gemma 3 and Granite is data (biases, q/k norms, (1 + w) norms, scaled
embeddings, the feed-forward norms around each block, the activation, soft-capping, multipliers,
sliding layers and their RoPE base), so the exporter has exactly one decoder.
"""
# Over 400 lines: the families' table and the one spec every row fills (its fields, shapes and
# parameter count); config.json's readers are apart (config_reader.py), and splitting the table
# from the spec would put each family's facts in two files.

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import UsageError
from .config_reader import (FULL, LIMITS, ROPE_TYPES, SLIDING, ConfigReader, read_rope,
                            rotary_dim_of, yarn_attention_factor, yarn_inv_freq)

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


@dataclass(frozen=True)
class ArchSpec:
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    torch_dtype: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Attention window of the sliding layers (None: no layer slides). A sliding layer keeps the
    # same ctx_len-long KV buffer as a full one; its mask hides keys `sliding_window` or more
    # positions behind the query (export/decoder.py says why not a ring buffer).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; () = all full
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): 1.0 for Gemma
    embedding_scale: float = 1.0  # the embedding rows are multiplied by this (Gemma: sqrt(H))
    sandwich_norms: bool = False  # pre/post feed-forward norms and a normed attention output
    attention_scale: float | None = None  # scores scale; None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    residual_scale: float = 1.0  # each attention / MLP output times this before its residual add
    logits_divisor: float = 1.0  # logits / this (Granite's logits_scaling)
    fused_projections: bool = False  # Phi-3's qkv_proj and gate_up_proj
    # Mixture of experts (0: none): experts, how many each token uses, their MLP width, whether
    # the chosen weights are renormalized, which layers route (the others are dense MLPs), and
    # the checkpoint's names (block, gate, up, down)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    moe_names: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")
    attention_sinks: bool = False
    stacked_experts: bool = False  # GPT-OSS's experts (see Family)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of head_dim only (None: all)
    local_rope_theta: float | None = None  # sliding layers' RoPE base where it differs
    local_rope_scaling: dict[str, Any] | None = None

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends to a window only; not where the window spans every position
        the model has (its graph is then a full layer's, op for op)."""
        return bool(self.sliding_window) and bool(self.layer_types) and \
            self.layer_types[layer] == SLIDING and \
            self.sliding_window < self.max_position_embeddings

    @property
    def scores_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def rope_ctx_limit(self) -> int | None:
        """The longest context whose RoPE is one fixed table: longrope switches every position
        to its long factors once a sequence passes original_max_position_embeddings (transformers
        recomputes the whole cache then), which a retained-state cache cannot follow."""
        s = self.rope_scaling or {}
        return s["original_max_position_embeddings"] if s.get("rope_type") == "longrope" else None

    @property
    def rope_attention_factor(self) -> float:
        """cos and sin are multiplied by this (longrope's attention factor; 1 otherwise)."""
        s = self.rope_scaling or {}
        if s.get("rope_type") == "yarn":
            return yarn_attention_factor(s)
        if s.get("rope_type") != "longrope":
            return 1.0
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        original = s["original_max_position_embeddings"]
        factor = s.get("factor") or self.max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def fused_ort_problem(self, ctx_len: int) -> str | None:
        """Why qpcbuild's fused ONNX Runtime lowering cannot run this model, or None. That
        lowering is Llama's block on ORT's GroupQueryAttention (with Qwen's biases and q/k
        norms, Granite's multipliers: the scores' one is the kernel's scale; Gemma 2/3's (1 + w)
        and sandwich norms, GeGLU, soft-capping and two RoPE bases; sliding windows as the
        kernel's local_window_size), and routed layers of SiLU experts on ORT's MoE kernel
        (Qwen3-MoE, Mixtral); Phi-3's partial and longrope RoPE and GPT-OSS's sinks, stacked
        experts and YaRN run on the portable graph (the exported one, exact). `ctx_len` is
        kept for callers: no limit on it remains."""
        if self.fused_projections or self.rope_dim != self.head_dim or \
                self.stacked_experts or self.attention_sinks or \
                self.rope_attention_factor != 1.0 or \
                (self.num_experts and self.hidden_act != "silu"):
            return f"the fused lowering does not build {self.family}'s layers"
        return None

    @property
    def param_count(self) -> int:
        if self.num_experts:  # every tensor the decoder reads, each once
            return sum(math.prod(shape) for shape in self.tensor_shapes().values())
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        per_layer += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + (2 * i + h) * self.mlp_bias
        per_layer += 2 * d * self.qk_norm + 2 * h * self.sandwich_norms
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @property
    def embedding_param_count(self) -> int:
        return self.vocab_size * self.hidden_size

    def matmul_param_count(self, head_rows: int | None = None) -> int:
        """Parameters of the compiled graph's MatMul weights (and norms): the layers and an LM
        head of `head_rows` rows (default: the vocabulary; fewer with a draft's vocabulary
        subset). A tied model's head is a MatMul weight of its own in our graphs (the compiler
        compresses constant MatMul weights, not a Transpose of the embedding), so the head
        counts once, tied or not; the embedding table, which is gathered, does not."""
        tables = self.embedding_param_count * (1 if self.tie_word_embeddings else 2)
        rows = self.vocab_size if head_rows is None else head_rows
        return self.param_count - tables + rows * self.hidden_size

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the decoder reads, by Hugging Face name, with its shape."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}"
            proj = {"q_proj": self.num_heads * d, "k_proj": self.num_kv_heads * d,
                    "v_proj": self.num_kv_heads * d}
            if self.fused_projections:
                proj = {"qkv_proj": sum(proj.values())}
            for name, out in proj.items():
                shapes[f"{p}.self_attn.{name}.weight"] = (out, h)
                if self.qkv_bias:
                    shapes[f"{p}.self_attn.{name}.bias"] = (out,)
            shapes[f"{p}.self_attn.o_proj.weight"] = (h, self.num_heads * d)
            if self.o_bias:
                shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
            if self.attention_sinks:
                shapes[f"{p}.self_attn.sinks"] = (self.num_heads,)
            if self.qk_norm:
                shapes[f"{p}.self_attn.q_norm.weight"] = (d,)
                shapes[f"{p}.self_attn.k_norm.weight"] = (d,)
            mlp = (("gate_up_proj", (2 * i, h)),) if self.fused_projections else \
                (("gate_proj", (i, h)), ("up_proj", (i, h)))
            if n in self.moe_layers:
                shapes.update(self.expert_shapes(n))
                mlp = ()
            for name, shape in (*mlp, ("down_proj", (h, i))) if mlp else ():
                shapes[f"{p}.mlp.{name}.weight"] = shape
                if self.mlp_bias:
                    shapes[f"{p}.mlp.{name}.bias"] = (shape[0],)
            shapes[f"{p}.input_layernorm.weight"] = (h,)
            shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
            if self.sandwich_norms:
                shapes[f"{p}.pre_feedforward_layernorm.weight"] = (h,)
                shapes[f"{p}.post_feedforward_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def expert_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The router and every expert's projections of a routed layer, by checkpoint name."""
        h, e, n = self.hidden_size, self.expert_intermediate_size, self.num_experts
        block, gate, up, down = self.moe_names
        p = f"model.layers.{layer}.{block}"
        if self.stacked_experts:  # GPT-OSS
            return {f"{p}.router.weight": (n, h), f"{p}.router.bias": (n,),
                    f"{p}.experts.gate_up_proj": (n, h, 2 * e),
                    f"{p}.experts.gate_up_proj_bias": (n, 2 * e),
                    f"{p}.experts.down_proj": (n, e, h), f"{p}.experts.down_proj_bias": (n, h)}
        shapes: dict[str, tuple[int, ...]] = {f"{p}.gate.weight": (self.num_experts, h)}
        for j in range(self.num_experts):
            shapes.update({f"{p}.experts.{j}.{gate}.weight": (e, h),
                           f"{p}.experts.{j}.{up}.weight": (e, h),
                           f"{p}.experts.{j}.{down}.weight": (h, e)})
        return shapes

    def to_dict(self) -> dict[str, Any]:
        """The manifest's `arch` object. The fields after `sliding_window` came with the newer
        families and are written only where they differ from their defaults: a manifest (and so
        the bundle id and cache keys) of a Llama, Mistral or Qwen model is unchanged by them."""
        d = asdict(self)
        defaults = ArchSpec.__dataclass_fields__
        for name in list(d)[list(d).index("sliding_window") + 1:]:
            f = defaults[name]
            default = f.default_factory() if f.default is MISSING else f.default
            if getattr(self, name) == default:
                del d[name]
        d.update({k: list(v) for k, v in d.items() if isinstance(v, tuple)})
        d["param_count"] = self.param_count
        return d

    @property
    def has_local_rope(self) -> bool:
        return self.local_rope_theta is not None

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """RoPE inverse frequencies [head_dim/2], float32, with the config's scaling applied;
        `local`: the sliding layers' own base (Gemma 3)."""
        dim = self.rope_dim
        theta = self.local_rope_theta if local else self.rope_theta
        inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        s = (self.local_rope_scaling if local else self.rope_scaling) or {}
        kind = s.get("rope_type", "default")
        if kind == "longrope":  # the short factors: contexts up to rope_ctx_limit
            inv = inv / np.asarray(s["short_factor"], np.float64)
        elif kind == "yarn":
            inv = yarn_inv_freq(inv, s, dim, theta)
        elif kind == "linear":
            inv = inv / s["factor"]
        elif kind == "llama3":
            factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old_len = s["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
            scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
            smooth = (old_len / wavelen - lo) / (hi - lo)
            blended = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
            inv = np.where(medium, blended, scaled)
        return inv.astype(np.float32)


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

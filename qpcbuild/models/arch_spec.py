"""The architecture spec: one frozen value holding every fact the exporter, the planners and
the ONNX Runtime lowering read about a model (sizes, norms, attention, RoPE, experts), with what
follows from them: tensor shapes, parameter counts, KV bytes, RoPE frequencies, the manifest's
`arch` object. arch.py fills it from config.json, one family at a time.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

import numpy as np

from .config_reader import SLIDING, yarn_attention_factor, yarn_inv_freq

__all__ = ["ArchSpec"]


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

"""Architecture facts read from a Hugging Face config.json.

Every supported family is one row of `FAMILIES`: what differs between Llama, Mistral, Qwen2 and
Qwen3 is data (biases, q/k norms), so the exporter has exactly one decoder.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import UsageError


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True),
}
ROPE_TYPES = ("default", "linear", "llama3")


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
    sliding_window: int | None = None  # attention window; qpcbuild requires ctx_len <= it

    @property
    def param_count(self) -> int:
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        per_layer += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + (2 * i + h) * self.mlp_bias
        per_layer += 2 * d * self.qk_norm
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
            for name, out in proj.items():
                shapes[f"{p}.self_attn.{name}.weight"] = (out, h)
                if self.qkv_bias:
                    shapes[f"{p}.self_attn.{name}.bias"] = (out,)
            shapes[f"{p}.self_attn.o_proj.weight"] = (h, self.num_heads * d)
            if self.o_bias:
                shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[f"{p}.self_attn.q_norm.weight"] = (d,)
                shapes[f"{p}.self_attn.k_norm.weight"] = (d,)
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)),
                                ("down_proj", (h, i))):
                shapes[f"{p}.mlp.{name}.weight"] = shape
                if self.mlp_bias:
                    shapes[f"{p}.mlp.{name}.bias"] = (shape[0],)
            shapes[f"{p}.input_layernorm.weight"] = (h,)
            shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["param_count"] = self.param_count
        return d

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim/2], float32, with the config's scaling applied."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        s = self.rope_scaling or {}
        kind = s.get("rope_type", "default")
        if kind == "linear":
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


# Sanity bounds: far above any released model, far below what would exhaust memory or overflow.
LIMITS = {"hidden_size": 1 << 17, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
          "head_dim": 1 << 12, "num_hidden_layers": 1 << 10, "intermediate_size": 1 << 20,
          "vocab_size": 1 << 22, "max_position_embeddings": 1 << 24, "sliding_window": 1 << 24}


class _Reader:
    """Typed reads of config.json values that collect every problem instead of stopping."""

    def __init__(self, config: dict[str, Any]):
        self.config, self.problems = config, []

    def int(self, key: str, default: Any = ..., allow_none: bool = False) -> int | None:
        value = self.config.get(key, default)
        if value is ...:
            self.problems.append(f"{key}: required, missing")
            return None
        if value is None and (allow_none or default is None):
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{key}: expected a positive integer, got {value!r}")
            return None
        if not 1 <= value <= LIMITS.get(key, 1 << 31):
            self.problems.append(f"{key}: {value} is outside 1..{LIMITS.get(key, 1 << 31)}")
            return None
        return value

    def number(self, key: str, value: Any, minimum_exclusive: float = 0.0) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or value <= minimum_exclusive:
            self.problems.append(f"{key}: expected a finite number > {minimum_exclusive:g}, got "
                                 f"{value!r}")
            return None
        return float(value)


def _rope(r: _Reader) -> tuple[float | None, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    config = r.config
    params = config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        r.problems.append(f"rope_parameters: expected an object, got {params!r}")
        params = {}
    theta = r.number("rope_theta", params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling and not isinstance(scaling, dict):
        r.problems.append(f"rope_scaling: expected an object, got {scaling!r}")
        return theta, None
    scaling = dict(scaling) if scaling else None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind not in ROPE_TYPES:
            r.problems.append(f"rope_scaling.rope_type: '{kind}' is not supported (supported: "
                              f"{', '.join(ROPE_TYPES)})")
            return theta, None
        needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor",
                                                    "high_freq_factor",
                                                    "original_max_position_embeddings")}
        for key in needed.get(kind, ()):
            r.number(f"rope_scaling.{key}", scaling.get(key))
        if kind == "llama3" and not r.problems and \
                scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            r.problems.append("rope_scaling: high_freq_factor must exceed low_freq_factor")
        if kind == "default":
            scaling = None
    return theta, scaling


def arch_from_config(config: dict[str, Any], source: str = "config.json") -> ArchSpec:
    """Read and check the facts the exporter needs. Every problem is reported at once, each
    naming its key; unsupported models get a clear error."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None) if isinstance(archs, list) else None
    if arch is None:
        raise UsageError(f"{source}: architecture {archs or config.get('model_type')} is not "
                         f"supported; supported: {', '.join(sorted(FAMILIES))}")
    fam = FAMILIES[arch]
    r = _Reader(config)
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
    # Qwen configs carry a window that is off unless use_sliding_window; Mistral's is on when set.
    window = r.int("sliding_window", None, allow_none=True)
    if config.get("use_sliding_window", config.get("model_type") == "mistral") is False:
        window = None
    theta, scaling = _rope(r)
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
        bos_token_id=bos, eos_token_ids=eos_ids, sliding_window=window,
    )

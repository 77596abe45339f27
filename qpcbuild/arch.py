"""Architecture facts read from a Hugging Face config.json.

Every supported family is one row of `FAMILIES`: what differs between Llama, Mistral, Qwen2 and
Qwen3 is data (biases, q/k norms), so the exporter has exactly one decoder.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .errors import UsageError


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

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

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


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    scaling = dict(scaling) if scaling else None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind not in ROPE_TYPES:
            raise UsageError(f"rope scaling type '{kind}' is not supported (supported: "
                             f"{', '.join(ROPE_TYPES)})")
        if kind == "default":
            scaling = None
    return theta, scaling


def arch_from_config(config: dict[str, Any], source: str = "config.json") -> ArchSpec:
    """Read and check the facts the exporter needs; unsupported models get a clear error."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        raise UsageError(f"{source}: architecture {archs or config.get('model_type')} is not "
                         f"supported; supported: {', '.join(sorted(FAMILIES))}")
    fam = FAMILIES[arch]
    try:
        h = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or h // heads)
        layers = int(config["num_hidden_layers"])
        inter = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{source}: missing or invalid key {exc}") from None
    if heads % kv:
        raise UsageError(f"{source}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv}")
    # Qwen configs carry a window that is off unless use_sliding_window; Mistral's is on when set.
    window = config.get("sliding_window")
    if config.get("use_sliding_window", config.get("model_type") == "mistral") is False:
        window = None
    theta, scaling = _rope(config)
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    attention_bias = bool(config.get("attention_bias", False))
    return ArchSpec(
        architecture=arch, family=fam.name, hidden_size=h, num_layers=layers, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=fam.qkv_bias or attention_bias, o_bias=attention_bias and fam.name != "qwen2",
        mlp_bias=bool(config.get("mlp_bias", False)), qk_norm=fam.qk_norm,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        bos_token_id=config.get("bos_token_id"), eos_token_ids=eos_ids,
        sliding_window=int(window) if window else None,
    )

"""Typed reads of config.json values for `arch_from_config` (models/arch.py): the reader that
collects every problem instead of stopping, and the RoPE facts (base, scaling, partial rotary,
Gemma 3's per-layer-type bases, Phi-3's longrope). Also a head folder's JSON config, read whole."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import UsageError

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
SLIDING, FULL = "sliding_attention", "full_attention"


# Sanity bounds: far above any released model, far below what would exhaust memory or overflow.
LIMITS = {"hidden_size": 1 << 17, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
          "head_dim": 1 << 12, "num_hidden_layers": 1 << 10, "intermediate_size": 1 << 20,
          "vocab_size": 1 << 22, "max_position_embeddings": 1 << 24, "sliding_window": 1 << 24}


def read_json_object(path: Path, missing: str) -> dict[str, Any]:
    """The JSON object in `path` (a head folder's config); UsageError naming the file, with
    `missing` as the reason when it is not there."""
    if not path.is_file():
        raise UsageError(f"{path.parent}: no {path.name}; {missing}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise UsageError(f"{path}: unreadable ({exc})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{path}: a JSON object expected")
    return cfg


class ConfigReader:
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


def read_rope(r: ConfigReader, local_rope: bool) -> tuple[
        tuple[float | None, dict[str, Any] | None],
        tuple[float | None, dict[str, Any] | None] | None]:
    """(theta, scaling) of the full layers and, for a family whose sliding layers have a base of
    their own, of those (else None)."""
    # transformers >= 5 writes `rope_parameters` (Gemma 3: one object per layer type); older
    # configs `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`).
    config = r.config
    params = config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        r.problems.append(f"rope_parameters: expected an object, got {params!r}")
        params = {}
    if FULL in params or SLIDING in params:
        full = _rope_params(r, params.get(FULL) or {}, f"rope_parameters.{FULL}", 1e6)
        local = _rope_params(r, params.get(SLIDING) or {}, f"rope_parameters.{SLIDING}", 1e4)
        return full, local if local_rope else None
    theta = r.number("rope_theta", params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    full = theta, _rope_scaling(r, scaling, "rope_scaling")
    if not local_rope:
        return full, None
    local = r.number("rope_local_base_freq", config.get("rope_local_base_freq", 10000.0))
    return full, (local, None)


def _rope_params(r: ConfigReader, params: Any, key: str,
                 default_theta: float) -> tuple[float | None, dict[str, Any] | None]:
    if not isinstance(params, dict):
        r.problems.append(f"{key}: expected an object, got {params!r}")
        return None, None
    theta = r.number(f"{key}.rope_theta", params.get("rope_theta", default_theta))
    return theta, _rope_scaling(r, {k: v for k, v in params.items() if k != "rope_theta"}, key)


def _rope_scaling(r: ConfigReader, scaling: Any, key: str) -> dict[str, Any] | None:
    if scaling and not isinstance(scaling, dict):
        r.problems.append(f"{key}: expected an object, got {scaling!r}")
        return None
    scaling = dict(scaling) if scaling else None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind not in ROPE_TYPES:
            r.problems.append(f"{key}.rope_type: '{kind}' is not supported (supported: "
                              f"{', '.join(ROPE_TYPES)})")
            return None
        needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor",
                                                    "high_freq_factor",
                                                    "original_max_position_embeddings")}
        for name in needed.get(kind, ()):
            r.number(f"{key}.{name}", scaling.get(name))
        if kind == "longrope":
            _longrope(r, scaling, key)
        if kind == "yarn":
            r.number(f"{key}.factor", scaling.get("factor"))
            original = scaling.get("original_max_position_embeddings",
                                   r.config.get("original_max_position_embeddings"))
            r.number(f"{key}.original_max_position_embeddings", original)
            scaling["original_max_position_embeddings"] = original
        if kind == "llama3" and not r.problems and \
                scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            r.problems.append(f"{key}: high_freq_factor must exceed low_freq_factor")
        if kind == "default":
            scaling = None
    return scaling


def _longrope(r: ConfigReader, scaling: dict[str, Any], key: str) -> None:
    """Phi-3's longrope: short and long factors (one per rotary frequency) and the pretraining
    length, which transformers 5 keeps in rope_parameters and older configs at the top level."""
    scaling.pop("partial_rotary_factor", None)  # read with the head's shape (rotary_dim_of)
    original = scaling.get("original_max_position_embeddings",
                           r.config.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        r.problems.append(f"{key}.original_max_position_embeddings: expected a positive "
                          f"integer, got {original!r}")
    scaling["original_max_position_embeddings"] = original
    for name in ("short_factor", "long_factor"):
        values = scaling.get(name)
        if not isinstance(values, list) or not values or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                for v in values):
            r.problems.append(f"{key}.{name}: expected a list of positive numbers, got "
                              f"{values!r}")


def rotary_dim_of(r: ConfigReader, head_dim: int | None,
                  scaling: dict[str, Any] | None) -> int | None:
    """RoPE's share of head_dim (Phi-3's partial_rotary_factor); None for all of it."""
    params = r.config.get("rope_parameters")
    factor = (params.get("partial_rotary_factor") if isinstance(params, dict) else None) or \
        r.config.get("partial_rotary_factor", 1.0)
    factor = r.number("partial_rotary_factor", factor)
    if not head_dim or factor is None:
        return None
    dim = int(head_dim * factor)
    if factor > 1.0 or dim < 2 or dim % 2:
        r.problems.append(f"partial_rotary_factor: {factor:g} of head_dim {head_dim} is {dim} "
                          "dimensions; RoPE needs an even number from 2 to head_dim")
        return None
    if scaling and scaling.get("rope_type") == "longrope":
        for name in ("short_factor", "long_factor"):
            if isinstance(scaling.get(name), list) and len(scaling[name]) != dim // 2:
                r.problems.append(f"rope_scaling.{name}: {len(scaling[name])} factors for "
                                  f"{dim // 2} rotary frequencies")
    return None if dim == head_dim else dim


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(s: dict[str, Any]) -> float:
    """YaRN's cos/sin scale: the config's attention_factor, else its mscale ratio, else
    0.1 ln(factor) + 1 (transformers' _compute_yarn_parameters)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s["factor"]
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(factor, s["mscale"]) / yarn_mscale(factor, s["mscale_all_dim"])
    return yarn_mscale(factor)


def yarn_inv_freq(inv: Any, s: dict[str, Any], dim: int, theta: float) -> Any:
    """YaRN: high frequencies (many rotations within the pretraining length) kept, low ones
    divided by `factor`, a linear ramp between the correction dimensions of beta_fast and
    beta_slow rotations (floored / ceiled unless `truncate` is false)."""
    import numpy as np

    factor, original = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the extrapolation (unscaled) share of each frequency
    return (inv / factor) * (1 - keep) + inv * keep

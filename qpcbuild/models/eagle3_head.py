"""EAGLE-3 draft heads in the speculators format (as vLLM and the `speculators` package load them),
read strictly and checked against the target they will draft for.

A head folder holds `config.json` and `model.safetensors`. The config has
`speculators_model_type: "eagle3"`, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids` (the
target layers whose INPUT hidden states feed the head; default 2, L // 2, L - 3),
`norm_before_residual` and `transformer_layer_config`, a Llama config for the head's one decoder
layer. The weights: `fc.weight` [H, n*H] (the n auxiliary states -> one H-wide feature),
`layers.0.*` (a Llama layer whose q/k/v read 2H: [norm(embedding); norm(feature)], with the extra
`hidden_norm`), `norm.weight`, `lm_head.weight` [Vd, H] and `d2t` [Vd] int64 (target id =
draft id + d2t[draft id]). `t2d` (training only) is allowed and ignored; the token embedding is
the target's own, so a folder carrying `embed_tokens.weight` is refused rather than silently
ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UsageError
from .config_reader import read_json_object
from .safetensors import WeightReader

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
D2T, T2D = "d2t", "t2d"
LAYER = "layers.0"


@dataclass(frozen=True)
class Eagle3HeadInfo:
    """What the plan, the graphs and the manifest need of a head: its shape and content digest."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool
    sha256: str  # over the config's numbers and every tensor's name and bytes


@dataclass(frozen=True)
class Eagle3Head:
    info: Eagle3HeadInfo
    weights: dict[str, np.ndarray]  # float32, by the format's names (d2t excluded)
    draft_to_target: np.ndarray  # [Vd] int64: the target id of each draft id


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default: the inputs of layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def weight_shapes(i: Eagle3HeadInfo) -> dict[str, tuple[int, ...]]:
    h, d = i.hidden_size, i.head_dim
    p = LAYER
    return {"fc.weight": (h, len(i.aux_layer_ids) * h),
            f"{p}.input_layernorm.weight": (h,), f"{p}.hidden_norm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (i.num_heads * d, 2 * h),
            f"{p}.self_attn.k_proj.weight": (i.num_kv_heads * d, 2 * h),
            f"{p}.self_attn.v_proj.weight": (i.num_kv_heads * d, 2 * h),
            f"{p}.self_attn.o_proj.weight": (h, i.num_heads * d),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate_proj.weight": (i.intermediate_size, h),
            f"{p}.mlp.up_proj.weight": (i.intermediate_size, h),
            f"{p}.mlp.down_proj.weight": (h, i.intermediate_size),
            "norm.weight": (h,), "lm_head.weight": (i.draft_vocab_size, h)}


def _whole(cfg: dict[str, Any], key: str, where: Path, low: int = 1) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise UsageError(f"{where}: {key} must be a whole number >= {low}, got {v!r}")
    return v


def _number(cfg: dict[str, Any], key: str, where: Path, default: float) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise UsageError(f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    cfg = read_json_object(path, f"an EAGLE-3 head folder holds it and {WEIGHTS_FILE} (the "
                                 "speculators format)")
    if cfg.get("speculators_model_type") != "eagle3":
        raise UsageError(f"{path}: speculators_model_type is "
                         f"{cfg.get('speculators_model_type')!r}, 'eagle3' expected")
    return cfg


def _info(folder: Path, cfg: dict[str, Any], num_layers: int, hidden: int,
          vocab: int) -> Eagle3HeadInfo:
    path = folder / CONFIG_FILE
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UsageError(f"{path}: transformer_layer_config must be an object (the Llama config "
                         "of the head's decoder layer)")
    where = path.with_name(f"{CONFIG_FILE}: transformer_layer_config")
    h = _whole(layer, "hidden_size", where)
    target_h = cfg.get("target_hidden_size")
    if target_h is not None and target_h != hidden:
        raise UsageError(f"{path}: target_hidden_size is {target_h!r}, the target's hidden size "
                         f"is {hidden}: this head was trained for another model")
    if h != hidden:
        raise UsageError(f"{path}: transformer_layer_config.hidden_size is {h}, the target's "
                         f"hidden size is {hidden}: this head was trained for another model")
    if "vocab_size" in layer and layer["vocab_size"] != vocab:
        raise UsageError(f"{path}: transformer_layer_config.vocab_size is "
                         f"{layer['vocab_size']!r}, the target's vocabulary has {vocab} tokens")
    heads = _whole(layer, "num_attention_heads", where)
    kv = _whole(layer, "num_key_value_heads", where) if "num_key_value_heads" in layer else heads
    if heads % kv:
        raise UsageError(f"{where}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv}")
    head_dim = _whole(layer, "head_dim", where) if layer.get("head_dim") is not None \
        else h // heads
    rope = layer.get("rope_parameters") or {}
    theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0)) \
        if isinstance(rope, dict) else None
    if (rope.get("rope_type", "default") if isinstance(rope, dict) else None) != "default" \
            or layer.get("rope_scaling"):
        raise UsageError(f"{where}: only unscaled RoPE is supported for a head")
    if layer.get("hidden_act", "silu") != "silu":
        raise UsageError(f"{where}: hidden_act must be silu, got {layer.get('hidden_act')!r}")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    ids = list(default_aux_layers(num_layers)) if ids is None else ids
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in ids):
        raise UsageError(f"{path}: eagle_aux_hidden_state_layer_ids must list target layers in "
                         f"0..{num_layers - 1} (the target has {num_layers}), got {ids!r}")
    nbr = cfg.get("norm_before_residual", False)
    if not isinstance(nbr, bool):
        raise UsageError(f"{path}: norm_before_residual must be true or false, got {nbr!r}")
    return Eagle3HeadInfo(
        hidden_size=h, intermediate_size=_whole(layer, "intermediate_size", where),
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rms_norm_eps=_number(layer, "rms_norm_eps", where, 1e-6),
        rope_theta=_number({"rope_theta": theta}, "rope_theta", where, 10000.0),
        draft_vocab_size=_whole(cfg, "draft_vocab_size", path),
        aux_layer_ids=tuple(ids), norm_before_residual=nbr, sha256="")


def _d2t(reader: WeightReader, file: Path, draft_vocab: int, vocab: int) -> np.ndarray:
    """d2t as target ids, checked: [Vd] int64, every mapped id a distinct target token."""
    info = reader.tensors.get(D2T)
    if info is None:
        raise UsageError(f"{file}: no '{D2T}' tensor (draft id -> target id offsets)")
    if info.dtype != "I64" or info.shape != (draft_vocab,) or info.length != 8 * draft_vocab:
        raise UsageError(f"{file}: '{D2T}' must be int64 of shape [{draft_vocab}] "
                         f"(draft_vocab_size), got {info.dtype} {list(info.shape)}")
    with open(info.file, "rb") as f:
        f.seek(info.start)
        offsets = np.frombuffer(f.read(info.length), dtype="<i8").astype(np.int64)
    ids = np.arange(draft_vocab, dtype=np.int64) + offsets
    if ids.min() < 0 or ids.max() >= vocab:
        raise UsageError(f"{file}: '{D2T}' maps draft ids to target ids outside 0..{vocab - 1} "
                         "(the target's vocabulary)")
    if len(np.unique(ids)) != draft_vocab:
        raise UsageError(f"{file}: '{D2T}' maps two draft ids to the same target token")
    return ids


def read_eagle3_head(folder: Path, num_layers: int, hidden_size: int,
                     vocab_size: int) -> Eagle3Head:
    """The head of `folder`, checked against the target's layers, hidden size and vocabulary
    (UsageError naming the file and the field)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder (an EAGLE-3 head folder is expected)")
    cfg = _read_config(folder)
    info = _info(folder, cfg, num_layers, hidden_size, vocab_size)
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise UsageError(f"{folder}: no {WEIGHTS_FILE}")
    reader = WeightReader([file])
    shapes = weight_shapes(info)
    extra = sorted(set(reader.tensors) - set(shapes) - {D2T, T2D})
    missing = sorted(set(shapes) - set(reader.tensors))
    if missing or extra:
        hint = " (the token embedding is the target's; this version takes no head copy)" \
            if any("embed_tokens" in e for e in extra) else ""
        raise UsageError(f"{file}: loaded strictly: " + "; ".join(
            ([f"missing {', '.join(missing[:4])}"] if missing else [])
            + ([f"unexpected {', '.join(extra[:4])}"] if extra else [])) + hint)
    digest = hashlib.sha256(json.dumps(
        {k: v for k, v in info.__dict__.items() if k != "sha256"}, sort_keys=True).encode())
    weights = {}
    for name, shape in shapes.items():
        stored = reader.stored(name, shape)  # shape checked: the message names the tensor
        if stored.non_finite():
            raise UsageError(f"{file}: tensor '{name}' holds NaN or infinite values")
        digest.update(f"{name}:{stored.sha256}\n".encode())
        weights[name] = np.ascontiguousarray(stored.widen(np.asarray(stored.values)),
                                             dtype=np.float32)
    d2t = _d2t(reader, file, info.draft_vocab_size, vocab_size)
    digest.update(f"{D2T}:{hashlib.sha256(d2t.tobytes()).hexdigest()}\n".encode())
    info = Eagle3HeadInfo(**{**info.__dict__, "sha256": digest.hexdigest()})
    return Eagle3Head(info, weights, d2t)

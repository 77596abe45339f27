"""Turbo draft heads (QEfficient's multi-projection speculator), read and checked.

The format, as QEfficient's `transformers/spd/turbo.py` loads it: a folder with
`speculator_config.json` ({"turbo_num_layers": L, "turbo_num_heads": N}) and
`speculator.safetensors`, whose keys are `projections.<head>.<layer>.linear.weight` [H, H] and
`.bias` [H] for every head < N and layer < L, loaded strictly (no key missing, none extra).
Head h is one ResBlock x + SiLU(W x + b) applied L times: the same module is repeated, so the
L stored copies of a head's weights must be equal. The heads read the target's last hidden
state after its final norm; their outputs go through the target's own LM head, so a head fits
a target exactly when the hidden sizes agree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from .config_reader import read_json_object
from .safetensors import WeightReader

CONFIG_FILE, WEIGHTS_FILE = "speculator_config.json", "speculator.safetensors"
MAX_HEADS, MAX_LAYERS = 32, 64


@dataclass(frozen=True)
class TurboHeadsInfo:
    """What the plan and the manifest need of a head folder: its shape and its content digest."""
    num_heads: int
    num_layers: int
    hidden_size: int
    sha256: str  # over the config's two numbers and every tensor's name and bytes


@dataclass(frozen=True)
class TurboHeads:
    info: TurboHeadsInfo
    weights: tuple[np.ndarray, ...]  # per head [H, H] float32, applied as x @ W.T
    biases: tuple[np.ndarray, ...]  # per head [H] float32


def weight_name(head: int, layer: int, kind: str) -> str:
    return f"projections.{head}.{layer}.linear.{kind}"


def _config(folder: Path) -> tuple[int, int]:
    path = folder / CONFIG_FILE
    cfg = read_json_object(path, f"a turbo head folder holds it and {WEIGHTS_FILE} "
                                 "(QEfficient's turbo format)")
    values = []
    for key, top in (("turbo_num_heads", MAX_HEADS), ("turbo_num_layers", MAX_LAYERS)):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise UsageError(f"{path}: {key} must be a whole number in 1..{top}, got {v!r}")
        values.append(v)
    return values[0], values[1]


def read_turbo_heads(folder: Path, hidden_size: int) -> TurboHeads:
    """The heads of `folder`, checked against the target's hidden size (UsageError naming the
    file and the problem)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder (a turbo head folder is expected)")
    heads, layers = _config(folder)
    reader = WeightReader([folder / WEIGHTS_FILE])
    expected = {weight_name(h, n, kind): (hidden_size, hidden_size) if kind == "weight"
                else (hidden_size,)
                for h in range(heads) for n in range(layers) for kind in ("weight", "bias")}
    missing = sorted(set(expected) - set(reader.tensors))
    extra = sorted(set(reader.tensors) - set(expected))
    if missing or extra:
        raise UsageError(f"{folder / WEIGHTS_FILE}: does not match {CONFIG_FILE} "
                         f"({heads} heads x {layers} layers, hidden size {hidden_size}), "
                         f"loaded strictly: " + "; ".join(
                             ([f"missing {', '.join(missing[:4])}"] if missing else [])
                             + ([f"unexpected {', '.join(extra[:4])}"] if extra else [])))
    for name, shape in expected.items():
        have = reader.tensors[name].shape
        if have != shape:
            raise UsageError(f"{folder / WEIGHTS_FILE}: tensor '{name}' has shape {list(have)}, "
                             f"the target's hidden size {hidden_size} needs {list(shape)}: "
                             "these heads were trained for another model")
    digest = hashlib.sha256(f"{heads},{layers}".encode())
    weights, biases = [], []
    for h in range(heads):
        per_kind = {}
        for kind in ("weight", "bias"):
            first = None
            for n in range(layers):
                stored = reader.stored(weight_name(h, n, kind), expected[weight_name(h, n, kind)])
                if stored.non_finite():
                    raise UsageError(f"{folder / WEIGHTS_FILE}: tensor "
                                     f"'{weight_name(h, n, kind)}' holds NaN or infinite values")
                digest.update(f"{weight_name(h, n, kind)}:{stored.sha256}\n".encode())
                values = stored.widen(np.asarray(stored.values)).astype(np.float32)
                if first is None:
                    first = values
                elif not np.array_equal(first, values):
                    raise UsageError(f"{folder / WEIGHTS_FILE}: head {h}'s layers differ "
                                     f"('{weight_name(h, 0, kind)}' and "
                                     f"'{weight_name(h, n, kind)}'); a turbo head repeats one "
                                     "ResBlock, so its weights are shared")
            per_kind[kind] = first
        weights.append(np.ascontiguousarray(per_kind["weight"]))
        biases.append(np.ascontiguousarray(per_kind["bias"]))
    info = TurboHeadsInfo(heads, layers, hidden_size, digest.hexdigest())
    return TurboHeads(info, tuple(weights), tuple(biases))

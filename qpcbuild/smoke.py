"""Smoke weights: random checkpoints with a recipe's exact shapes, for checking a recipe end to end
(export, compiler inputs, emit-only bundle) on a machine that lacks the real weights.

They are marked as such everywhere they appear (folder name, config, manifest source path), and
a bundle built from them is only good for checking the toolchain, never for serving.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from .models.arch import arch_from_config
from .models.source import resolve
from .plan import digest
from .recipe import Recipe, resolve_model_path

POOL_ELEMENTS = 1 << 22  # one pool of random values, cycled through every tensor


def write_random_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str,
                             seed: int = 0) -> None:
    """Write one safetensors file of N(0, 0.02) values (ones for norms).

    The values come from one seeded pool of 4M draws, read from a random start for each
    tensor: drawing GBs of fresh normals would cost more than writing them, and smoke
    weights only have to be finite, of the right shapes, and not constant."""
    code, size = {"bfloat16": ("BF16", 2), "float16": ("F16", 2)}.get(dtype, ("F32", 4))
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * size
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    rng = np.random.default_rng(seed)

    def encode(x: np.ndarray) -> bytes:
        if code == "BF16":
            return (x.view(np.uint32) >> 16).astype("<u2").tobytes()
        return x.astype("<f2" if code == "F16" else "<f4").tobytes()

    pool = encode(rng.standard_normal(POOL_ELEMENTS, dtype=np.float32) * 0.02)
    ones = encode(np.ones(POOL_ELEMENTS, np.float32))
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            left = int(np.prod(shape)) * size
            source = ones if name.endswith("norm.weight") else pool
            start = int(rng.integers(POOL_ELEMENTS)) * size
            while left:
                piece = memoryview(source)[start:start + left]
                fh.write(piece)
                left -= len(piece)
                start = 0


def smoke_model(config: dict, folder: Path, layers: int | None, of: str = "") -> Path:
    """A cached random checkpoint for `config` (optionally with fewer layers)."""
    config = dict(config, qpcbuild_smoke_of=of)
    if layers:
        config["num_hidden_layers"] = min(layers, int(config["num_hidden_layers"]))
        if isinstance(config.get("layer_types"), list):  # per-layer kinds (Gemma 2/3, GPT-OSS)
            config["layer_types"] = config["layer_types"][:config["num_hidden_layers"]]
    config["qpcbuild_smoke_weights"] = True
    out = folder / f"smoke-{digest(config)}"
    if (out / "model.safetensors").is_file():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smoke-", dir=folder))
    try:
        arch = arch_from_config(config)
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        write_random_safetensors(tmp / "model.safetensors", arch.tensor_shapes(),
                                 str(config.get("torch_dtype") or config.get("dtype") or "float32"))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def with_smoke_weights(r: Recipe, folder: Path, layers: int | None,
                       say: Callable[[str], None] = print) -> Recipe:
    """The same recipe with every model replaced by a random checkpoint of its shapes."""
    update = {}
    refs = {"target": r.target} | ({"draft": r.draft} if r.draft.method == "draft_model" else {})
    for role, ref in refs.items():
        src = resolve(resolve_model_path(r, ref.model), ref.revision)
        path = smoke_model(src.config, folder, layers, ref.model)
        say(f"smoke weights for {role} ({ref.model}, "
            f"{json.loads((path / 'config.json').read_text())['num_hidden_layers']} layers): {path}")
        update[role] = ref.model_copy(update={"model": str(path), "revision": None})
    return r.model_copy(update=update)

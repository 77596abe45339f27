"""Checkpoint against config: the tensors a model folder holds are exactly the ones its
config.json describes. Reads safetensors headers only, so it runs at plan time in milliseconds.
A checkpoint with tensors the decoder would not read (a 6-layer model under a config that says
3 layers) is refused: exporting it would silently build a different model."""

from __future__ import annotations

import re
from pathlib import Path

from .arch import ArchSpec
from .safetensors import read_header
from .source import safetensors_files

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _ignorable(name: str, arch: ArchSpec) -> bool:
    # Older checkpoints store RoPE tables; tied ones sometimes store the head copy as well.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight"
                                                     and arch.tie_word_embeddings)


def _listed(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit
                                       else "")


def checkpoint_problems(path: Path, arch: ArchSpec, allow_pickle: bool = False,
                        allow_unused: bool = False) -> list[str]:
    """What is wrong with the weights of `path` for `arch` (empty: they match)."""
    files = safetensors_files(path, allow_pickle)
    if any(f.suffix != ".safetensors" for f in files):
        return []  # an opted-in pickle checkpoint is checked tensor by tensor while exporting
    tensors = {}
    for f in files:
        tensors.update(read_header(f))
    expected = arch.tensor_shapes()
    problems = []
    packed = sorted(n for n in tensors if n.endswith(("_blocks", "_scales")))
    if arch.stacked_experts and packed:  # GPT-OSS as released: MXFP4 experts
        return [f"the experts are MXFP4-packed ({_listed(packed, 2)}); qpcbuild reads float "
                "weights: dequantize them first (transformers: from_pretrained(..., "
                "quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained)"]
    missing = [n for n in expected if n not in tensors]
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config implies are missing from the "
                        f"checkpoint: {_listed(missing)}")
    wrong = [f"{n} is {list(tensors[n].shape)} in {tensors[n].file}, the config implies "
             f"{list(shape)}" for n, shape in expected.items()
             if n in tensors and tensors[n].shape != shape]
    if wrong:
        problems.append("tensor shapes do not match config.json: " + _listed(wrong, 3))
    unused = sorted(n for n in tensors if n not in expected and not _ignorable(n, arch))
    if unused and not allow_unused:
        layers = {int(m.group(1)) for n in tensors if (m := _LAYER.match(n))}
        hint = (f" (the checkpoint has {max(layers) + 1} layers, config.json says "
                f"num_hidden_layers: {arch.num_layers})"
                if layers and max(layers) + 1 != arch.num_layers else "")
        problems.append(f"{len(unused)} tensor(s) in the checkpoint would not be used"
                        f"{hint}: {_listed(unused)}; fix config.json, or set "
                        "`allow_unused_weights: true` for this model if that is intended")
    return problems

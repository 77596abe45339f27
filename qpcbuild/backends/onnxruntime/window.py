"""How many keys the installed ONNX Runtime's GroupQueryAttention keeps for `local_window_size`,
asked of the kernel itself.

transformers keeps key k for query q when q - window < k <= q (`window` keys). The CPU kernel of
onnxruntime 1.32 keeps q - local_window_size < k <= q, the same count; the CPU source of earlier
releases (contrib_ops/cpu/bert/gqa_attention_base.h) keeps one key more (q - local_window_size
<= k <= q). The contrib op's documentation does not say which, so the fused lowering measures it
once per process on a one-head graph rather than trust a version number. The onnxruntime
version is in every artifact's cache key, so a graph built for one reading is rebuilt under the
other; and a graph records the reading it was built for (its metadata), which the runtime checks
against the kernel it loads, since a bundle may run where another onnxruntime is installed.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from ...errors import ToolchainError
from ...export import MS
from ...models.arch import ArchSpec

READING = "gqa_local_window_extra_keys"  # the graph's metadata: keys kept beyond the attribute

_PROBE_LEN, _PROBE_WINDOW, _HEAD = 8, 2, 8  # the kernel wants head_size % 8 == 0


@lru_cache(maxsize=None)
def keys_kept(local_window_size: int = _PROBE_WINDOW) -> int:
    """Keys the kernel attends to for the last of _PROBE_LEN tokens of a prompt with this
    attribute. Scores are all zero (q = 0), so the output is the mean of the kept keys' values,
    which are their slot numbers: the mean says how many were kept."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n, d = _PROBE_LEN, _HEAD
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens",
                                                    "total"], ["out", "k_out", "v_out"],
                            domain=MS, num_heads=1, kv_num_heads=1, scale=1.0,
                            local_window_size=local_window_size)
    floats = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in
              (("q", [1, n, d]), ("k", [1, n, d]), ("v", [1, n, d]), ("past_k", [1, 1, n, d]),
               ("past_v", [1, 1, n, d]))]
    ints = [helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
            for name in ("out", "k_out", "v_out")]
    model = helper.make_model(helper.make_graph([node], "window_probe", floats + ints, outs),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid(MS, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), opts,
                                   providers=["CPUExecutionProvider"])
    zeros = np.zeros((1, n, d), np.float32)
    slots = np.repeat(np.arange(n, dtype=np.float32)[None, :, None], d, axis=2)
    cache = np.zeros((1, 1, n, d), np.float32)
    out = session.run(["out"], {"q": zeros, "k": zeros, "v": slots, "past_k": cache,
                                "past_v": cache, "seqlens": np.array([n - 1], np.int32),
                                "total": np.array(n, np.int32)})[0]
    mean = float(out[0, -1, 0])  # of slots n - kept .. n - 1
    return round(2 * (n - 1 - mean) + 1)


def local_window_size(window: int) -> int:
    """The attribute with which the installed kernel keeps transformers' `window` keys."""
    extra = keys_kept() - _PROBE_WINDOW
    if extra not in (0, 1):
        raise ToolchainError(
            f"onnxruntime's GroupQueryAttention kept {keys_kept()} keys for local_window_size "
            f"{_PROBE_WINDOW}; the fused lowering knows kernels that keep {_PROBE_WINDOW} or "
            f"{_PROBE_WINDOW + 1}. Use `onnxruntime: {{graph: portable}}`.")
    return window - extra


def windowed(arch: ArchSpec, ctx_len: int) -> bool:
    """Whether the fused graph of `arch` at `ctx_len` sets local_window_size on some layer
    (a window shorter than ctx_len)."""
    return any(arch.is_sliding(i) for i in range(arch.num_layers)) and \
        bool(arch.sliding_window) and arch.sliding_window < ctx_len


def reading() -> dict[str, str]:
    """The metadata a windowed graph carries: the installed kernel's reading."""
    return {READING: str(keys_kept() - _PROBE_WINDOW)}


def reading_problem(model_path: Path) -> str | None:
    """Why the installed kernel would attend to other keys than the fused graph at
    `model_path` was built for, or None (also for a graph without a windowed layer: it records
    no reading). Reads the graph's metadata only (milliseconds: the weights are external)."""
    import onnx

    meta = {p.key: p.value for p in
            onnx.load(str(model_path), load_external_data=False).metadata_props}
    built = meta.get(READING)
    if built is None or built == reading()[READING]:
        return None
    here = reading()[READING]
    return (f"{model_path}: its sliding layers were built for a GroupQueryAttention that keeps "
            f"{built} key(s) beyond local_window_size; the "
            f"installed onnxruntime keeps {here}, so its windows would differ from the model's. "
            "Rebuild the bundle with this onnxruntime (`qpcbuild compile`), or install the one "
            "it was built with.")

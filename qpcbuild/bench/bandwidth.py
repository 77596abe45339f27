"""Target-only decode against this machine's memory bandwidth.

A decode step of a small-batch LLM reads every weight once and the valid part of the KV cache,
and does little arithmetic per byte, so its ceiling is bytes per token / memory bandwidth. Two
figures make that check:

* bytes per token, read off the target's ONNX Runtime graph: every initializer counts in full,
  except tables the graph reads by index (the embedding under a Gather, the RoPE cos/sin caches
  of GroupQueryAttention), which count one row per token; plus the KV cache up to the mean
  number of valid positions during the run (attention reads only those).
* the rate a weight-streaming kernel reaches here: ONNX Runtime's own MatMul of one row against
  a float32 matrix as large as the target's weights (so no cache holds it), on as many threads
  as the target's session uses. That is the same kernel family the decode spends its time in;
  the ratio therefore measures what the rest of the graph and the per-call host work cost.

The probe runs right after each repeat's target-only pass: a shared machine's memory bandwidth
drifts over minutes, so only a rate measured next to the decode is its limit.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from ..ort_threads import session_options
from ..runtime.stats import SpecDecodingStats

PROBE_ROWS = 1024          # inner dimension of the probe's MatMul
PROBE_CALLS = 15           # timed calls; the median is reported
PROBE_MAX_BYTES = 1 << 30  # 1 GiB caps the probe's matrix for larger targets
# GroupQueryAttention's cos_cache / sin_cache inputs (contrib op schema): read at position ids.
GQA_TABLE_INPUTS = (7, 8)


def _itemsize(data_type: int) -> float:
    import onnx
    import numpy as np

    if data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return 0.5
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type)).itemsize


def graph_bytes(model_path: Path) -> dict[str, float]:
    """Bytes of the graph's initializers: read in full per call, and read by index (row bytes)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    indexed: dict[str, bool] = {}  # initializer -> consumed only as an indexed table so far
    for node in model.graph.node:
        for pos, name in enumerate(node.input):
            by_index = ((node.op_type == "Gather" and pos == 0)
                        or (node.op_type == "GroupQueryAttention" and pos in GQA_TABLE_INPUTS))
            indexed[name] = indexed.get(name, True) and by_index
    full = row = 0.0
    for init in model.graph.initializer:
        dims = list(init.dims)
        size = _itemsize(init.data_type)
        count = 1
        for d in dims:
            count *= d
        if indexed.get(init.name) and dims:
            row += size * count / dims[0]
        else:
            full += size * count
    return {"full_bytes": full, "indexed_row_bytes": row}


class StreamingProbe:
    """ONNX Runtime's MatMul of a [1, R] row with a float32 [R, N] matrix as large as the
    target graph's weights (`graph`: its `graph_bytes`): the rate a weight-streaming kernel
    reaches here. Built once; `measure()` is called right after each target-only pass, because
    a shared machine's memory bandwidth drifts over minutes."""

    def __init__(self, graph: dict[str, float], threads: int) -> None:
        import numpy as np
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper

        self.graph = graph
        self.rates: list[float] = []  # GB/s of each measure() call
        cols = max(1, int(min(graph["full_bytes"], PROBE_MAX_BYTES) // (4 * PROBE_ROWS)))
        weight = np.random.default_rng(0).standard_normal((PROBE_ROWS, cols), dtype=np.float32)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], "stream",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, PROBE_ROWS])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])],
            [onnx.numpy_helper.from_array(weight, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        opts, _ = session_options(threads)  # the target's threads (its pool, if it has one)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
        self.sess = ort.InferenceSession(model.SerializeToString(), opts,
                                         providers=["CPUExecutionProvider"])
        self.x = {"x": np.ones((1, PROBE_ROWS), np.float32)}
        self.matrix_bytes = 4.0 * PROBE_ROWS * cols
        self.threads = threads
        self.kernel = f"onnxruntime MatMul [1,{PROBE_ROWS}] x float32 [{PROBE_ROWS},{cols}]"

    def measure(self) -> float:
        """GB/s: the matrix over the median of PROBE_CALLS timed calls (after 3 untimed); each
        result is also kept in `rates`."""
        for _ in range(3):
            self.sess.run(None, self.x)
        times = []
        for _ in range(PROBE_CALLS):
            t0 = time.perf_counter()
            self.sess.run(None, self.x)
            times.append(time.perf_counter() - t0)
        self.rates.append(self.matrix_bytes / statistics.median(times) / 1e9)
        return self.rates[-1]


def make_probe(gen) -> StreamingProbe | None:
    """A probe as large as the target's weights, on the target session's threads; None when
    the target is not an ONNX Runtime session."""
    path = getattr(gen.target, "path", None)
    if path is None:
        return None
    return StreamingProbe(graph_bytes(Path(path)), gen.target.threads)


def target_only_bandwidth(gen, base_stats: SpecDecodingStats | None, prompt_lengths: list[int],
                          decode_tokens_per_s: float | None,
                          probe: StreamingProbe | None) -> dict[str, Any] | None:
    """Bytes per decoded token x target-only decode tokens/s, against the streaming probe's
    rates measured next to the target-only passes. None without an ONNX Runtime target."""
    probe_gbs = probe.rates if probe is not None else []
    if not probe_gbs or not decode_tokens_per_s:
        return None
    arch = gen.manifest.target.arch
    g = probe.graph
    new = base_stats.new_tokens / max(1, base_stats.requests)
    mean_positions = statistics.fmean(prompt_lengths) + new / 2
    kv_per_position = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4
    kv = kv_per_position * mean_positions
    per_token = g["full_bytes"] + g["indexed_row_bytes"] + kv
    achieved = per_token * decode_tokens_per_s / 1e9
    limit = statistics.median(probe_gbs)
    return {"bytes_per_token_mb": round(per_token / 1e6, 2),
            "weights_mb": round(g["full_bytes"] / 1e6, 2),
            "kv_mb_at_mean_context": round(kv / 1e6, 3),
            "mean_valid_positions": round(mean_positions, 1),
            "decode_tokens_per_s": round(decode_tokens_per_s, 2),
            "achieved_gbs": round(achieved, 2),
            "probe": {"gbs": round(limit, 3), "per_repeat_gbs": [round(x, 3) for x in probe_gbs],
                      "kernel": probe.kernel, "threads": probe.threads,
                      "matrix_mb": round(probe.matrix_bytes / 1e6, 1), "calls": PROBE_CALLS,
                      "when": "right after each repeat's target-only pass"},
            "fraction_of_probe": round(achieved / limit, 3)}


def bandwidth_line(b: dict[str, Any]) -> str:
    p = b["probe"]
    return (f"target-only decode: {b['bytes_per_token_mb']:,.1f} MB per token (weights "
            f"{b['weights_mb']:,.1f} MB + KV {b['kv_mb_at_mean_context']:,.2f} MB at "
            f"{b['mean_valid_positions']:.0f} positions) x {b['decode_tokens_per_s']:,.1f} "
            f"tokens/s = {b['achieved_gbs']:,.1f} GB/s; weight streaming on this machine "
            f"({p['kernel']}, {p['threads']} threads): {p['gbs']:,.1f} GB/s -> "
            f"{b['fraction_of_probe']:.0%} of it")

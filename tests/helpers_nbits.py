"""MatMulNBits read back two ways: a numpy dequantization written from the contrib op's
specification, and ONNX Runtime's kernel on one node (test_weight_formats.py,
test_nbits_search.py)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def spec_dequantize(packed: np.ndarray, scales: np.ndarray, bits: int, k: int,
                    zero_points: np.ndarray | None = None) -> np.ndarray:
    """[K, N] float32 from MatMulNBits inputs, one code at a time as the spec reads them
    (zero_points: per column ceil(blocks * bits / 8) bytes, low bits first; None: 2^(bits-1))."""
    n, blocks, blob = packed.shape
    block = blob * 8 // bits
    out = np.zeros((n, blocks * block), np.float64)
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    zp_bytes = -(-blocks * bits // 8)

    def code_at(row: np.ndarray, j: int) -> int:
        return (int(row[j // per_byte]) >> (bits * (j % per_byte))) & mask  # low bits first

    for col in range(n):
        for b in range(blocks):
            s = float(scales[col * blocks + b])
            zero = 1 << (bits - 1) if zero_points is None else \
                code_at(zero_points[col * zp_bytes:(col + 1) * zp_bytes], b)
            for j in range(block):
                out[col, b * block + j] = (code_at(packed[col, b], j) - zero) * s
    return out[:, :k].T.astype(np.float32)


def ort_matmul_nbits(x, packed, scales, k, n, bits, accuracy_level, block=32, zero_points=None):
    import onnxruntime as ort

    inits = [numpy_helper.from_array(packed, "q"), numpy_helper.from_array(scales, "s")]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "z"))
    node = helper.make_node("MatMulNBits", ["x", "q", "s"] + (["z"] if zero_points is not None
                                                             else []), ["y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                            accuracy_level=accuracy_level)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]

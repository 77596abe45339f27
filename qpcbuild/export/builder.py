"""A tiny ONNX graph builder: sequential names (so graphs are byte-for-byte deterministic) and
weights appended to one external data file as they are streamed in."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ALIGN = 4096  # page-aligned offsets let ONNX Runtime memory-map the weights
BLOCK_ELEMENTS = 1 << 24  # at most 64 MiB of float32 staged per write
TILE = 64


def weight_key(name: str, transpose: bool, subset: bool, offset: float) -> str:
    """The exported graph's name of one form of checkpoint tensor `name`: transposed (a MatMul
    weight), cut to a draft's vocabulary subset, or offset (Gemma's 1 + w)."""
    key = f"{name}{'^T' if transpose else ''}{'[subset]' if subset else ''}"
    return key + (f"+{offset:g}" if offset else "")


class GraphBuilder:
    def __init__(self, data_file: BinaryIO, data_name: str):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._count = 0
        self._consts: dict[tuple, str] = {}
        self._data, self._data_name, self._offset = data_file, data_name, 0
        self.weight_hashes: dict[str, str] = {}
        self.functions: dict[str, onnx.FunctionProto] = {}  # model-local, by name

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, out: str | None = None, n_out: int = 1,
           **attrs) -> str | list[str]:
        outs = [out] if out else [self._name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs,
                                           name=f"n{len(self.nodes)}_{op_type}", **attrs))
        return outs[0] if n_out == 1 else outs

    def call(self, function: onnx.FunctionProto, *inputs: str, out: str | None = None,
             **attrs) -> str:
        """A node calling a model-local function (added to the model once)."""
        self.functions.setdefault(function.name, function)
        out = out or self._name(function.name.lower())
        self.nodes.append(helper.make_node(function.name, list(inputs), [out],
                                           name=f"n{len(self.nodes)}_{function.name}",
                                           domain=function.domain, **attrs))
        return out

    def const(self, value, dtype=np.int64) -> str:
        """Small constants, deduplicated, stored inline."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self._name("const")
            self.initializers.append(numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    def weight(self, name: str, arr: np.ndarray, source_digest: str | None = None,
               dtype: np.dtype | type | None = None,
               widen: Callable[[np.ndarray], np.ndarray] | None = None) -> str:
        """A large tensor written to the external data file at a page-aligned offset, block by
        block, so a multi-GB matrix is never copied whole. `widen` turns any slice of `arr`
        into float32 (stored bfloat16 bits); `dtype` is what the file holds."""
        if dtype is None:
            dtype = np.float32 if widen else arr.dtype
        dtype = np.dtype(dtype).newbyteorder("<")
        pad = (-self._offset) % ALIGN
        if pad:
            self._data.write(b"\0" * pad)
            self._offset += pad
        digest = None if source_digest else hashlib.sha256()
        length = 0
        for block in _c_order_blocks(arr, dtype, widen):
            raw = memoryview(block).cast("B")
            self._data.write(raw)
            if digest:
                digest.update(raw)
            length += len(raw)
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(dtype)
        tensor.dims.extend(arr.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self._data_name), ("offset", str(self._offset)),
                           ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self._offset += length
        self.initializers.append(tensor)
        self.weight_hashes[name] = source_digest or digest.hexdigest()
        return name

    def input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, elem: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def model(self, graph_name: str, opset: int, metadata: dict[str, str]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs,
                                  self.initializers)
        domains = sorted({f.domain for f in self.functions.values()})
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)] + [
            helper.make_opsetid(d, 1) for d in domains], producer_name="qpcbuild",
            functions=[self.functions[k] for k in sorted(self.functions)])
        model.ir_version = 8  # opset 17 era; accepted by older runtimes and the Qualcomm SDK
        helper.set_model_props(model, metadata)
        return model


def _c_order_blocks(arr: np.ndarray, dtype: np.dtype,
                    widen: Callable[[np.ndarray], np.ndarray] | None = None):
    """`arr` (through `widen`, then cast to `dtype`) in C order, as consecutive row blocks of
    at most BLOCK_ELEMENTS, staged in one reused buffer.

    A transposed matrix (the layout of every MatMul weight) is copied tile by tile, which keeps
    both sides in cache: numpy's element-wise copy of a transposed view runs 2-5x slower."""
    take = widen or (lambda part: part)
    if widen is None and arr.flags.c_contiguous and arr.dtype == dtype:
        yield arr
        return
    if arr.ndim != 2:
        yield np.ascontiguousarray(take(arr), dtype=dtype)
        return
    n_rows, n_cols = arr.shape
    rows = max(1, min(n_rows, BLOCK_ELEMENTS // max(1, n_cols)))
    buf = np.empty((rows, n_cols), dtype)
    transposed = not arr.flags.c_contiguous and arr.T.flags.c_contiguous
    for start in range(0, n_rows, rows):
        block = buf[:min(rows, n_rows - start)]
        if transposed:  # each tile reads TILE source rows and writes TILE columns of the block
            for col in range(0, n_cols, TILE):
                block[:, col:col + TILE] = take(arr[start:start + len(block), col:col + TILE])
        else:
            block[...] = take(arr[start:start + len(block)])
        yield block


def save(model: onnx.ModelProto, path: Path) -> None:
    path.write_bytes(model.SerializeToString(deterministic=True))

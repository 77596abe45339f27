"""QEfficient's op vocabulary for the card graph, as ONNX model-local functions.

The Cloud AI compiler recognises a few function names that Qualcomm's QEfficient emits for every
causal LM it exports: `com.qualcomm.cloud::CtxScatter` / `CtxGather` (KV cache write and read,
with `CB` variants that route rows through `batch_index`) and `com.qti.aisw.onnx::CustomRMSNorm`.
A model-local function carries its own body of standard ops, so ONNX Runtime runs the same graph
by inlining it. Names, domains, input order, attributes and the bodies' op forms follow
QEfficient's exports (`qpcbuild doctor` checks them against its recorded graphs).

Invalid indices, as QEfficient's TorchScript export writes them: INT32_MAX.
- reads (`CtxGather*`): KV slots past a row's last position gather at INT32_MAX (QEfficient's
  comment: index 0 can cost performance on the card); the values read there are zeroed and the
  keys masked, so what is read never matters;
- writes: the plain `CtxScatter` takes a padded token's position -1 (slot ctx_len-1, masked
  until a real token overwrites it), as QEfficient passes it; `CtxScatterCB` takes INT32_MAX for
  a padded token, as QEfficient passes it, so the card never sees a negative index there.
ONNX Runtime refuses out-of-range indices, so its copies of the graph (the portable ORT artifact,
tests running the card graph) replace the two INT32_MAX initializers through
`onnxruntime_indices`: 0 for reads (what QEfficient's ORT runner substitutes) and -1 for the
continuous-batching writes (slot ctx_len-1, the plain scatter's own convention).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from . import OPSET

CLOUD = "com.qualcomm.cloud"
AISW = "com.qti.aisw.onnx"
DOMAINS = (CLOUD, AISW)
INT32_MAX = 2**31 - 1
# The card graph's invalid indices, each its own initializer, and what ONNX Runtime gets instead
INVALID_GATHER_INDEX, INVALID_SCATTER_INDEX = "invalid_gather_index", "invalid_scatter_index"
ONNXRUNTIME_INDICES = {INVALID_GATHER_INDEX: 0, INVALID_SCATTER_INDEX: -1}


class _Body:
    """Nodes of one function body, with sequential local names."""

    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self.prefix, self.count = prefix, 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        self.count += 1
        out = out or f"{self.prefix}_{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def ints(self, *values: int) -> str:
        return self.op("Constant", value=helper.make_tensor(f"c{self.count}", TensorProto.INT64,
                                                            [len(values)], list(values)))

    def dim(self, tensor: str, axis: int) -> str:
        """[1]-shaped int64 size of `tensor` along `axis`: Gather(Shape(x), [axis]), the form of
        QEfficient's bodies (no Shape start/end)."""
        return self.op("Gather", self.op("Shape", tensor), self.ints(axis))

    def arange(self, size_1d: str) -> str:
        """Range(0, n, 1) over a [1]-shaped n, as QEfficient's bodies call it (ONNX Runtime and
        the compiler take one-element tensors for Range's scalars)."""
        return self.op("Range", self.ints(0), size_1d, self.ints(1))


def _scatter_indices(b: _Body, rows: str, rows_axes: list[int], size: str, heads: str,
                     positions: str) -> str:
    """ScatterND indices [B, nKV, S, 3] = (row, head, slot) for updates [B, nKV, S, D]; `rows`
    is unsqueezed along `rows_axes` to [B, 1, 1, 1]."""
    shape = b.op("Concat", size, heads, b.dim(positions, 1), b.ints(1), axis=0)
    parts = [b.op("Expand", b.op("Unsqueeze", rows, b.ints(*rows_axes)), shape),
             b.op("Expand", b.op("Unsqueeze", b.arange(heads), b.ints(0, 2, 3)), shape),
             b.op("Expand", b.op("Unsqueeze", positions, b.ints(1, 3)), shape)]
    return b.op("Concat", *parts, axis=3)


def ctx_scatter() -> onnx.FunctionProto:
    """CtxScatter(data [B,nKV,C,D], position_ids [B,S], updates [B,nKV,S,D]) -> data with each
    update written at its position (a padded token's -1 writes slot C-1)."""
    b = _Body("cs")
    size = b.dim("data", 0)
    idx = _scatter_indices(b, b.arange(size), [1, 2, 3], size, b.dim("data", 1), "position_ids")
    b.op("ScatterND", "data", idx, "updates", out="output")
    return _function("CtxScatter", ["data", "position_ids", "updates"], b)


def ctx_scatter_cb() -> onnx.FunctionProto:
    """CtxScatterCB(data [FBS,nKV,C,D], batch_index [B,1], position_ids [B,S], updates): row b
    of the updates goes to KV slot batch_index[b]. Padded tokens come with INT32_MAX (see the
    module docstring)."""
    b = _Body("csb")
    idx = _scatter_indices(b, "batch_index", [2, 3], b.dim("batch_index", 0), b.dim("data", 1),
                           "position_ids")
    b.op("ScatterND", "data", idx, "updates", out="output")
    return _function("CtxScatterCB", ["data", "batch_index", "position_ids", "updates"], b)


def ctx_gather() -> onnx.FunctionProto:
    """CtxGather(data [B,nKV,C,D], ctx_indices [B,1,L], comp_ctx_len [] = L) -> [B,nKV,L,D]."""
    b = _Body("cg")
    first_two = b.op("Slice", b.op("Shape", "data"), b.ints(0), b.ints(2), b.ints(0),
                     b.ints(1))
    shape = b.op("Concat", first_two, b.op("Reshape", "comp_ctx_len", b.ints(1)), axis=0)
    idx = b.op("Unsqueeze", b.op("Expand", "ctx_indices", shape), b.ints(-1))
    b.op("GatherND", "data", idx, batch_dims=2, out="output")
    return _function("CtxGather", ["data", "ctx_indices", "comp_ctx_len"], b)


def ctx_gather_cb() -> onnx.FunctionProto:
    """CtxGatherCB(data [FBS,nKV,C,D], batch_index [B,1], ctx_indices [B,1,L], comp_ctx_len)
    -> [B,nKV,L,D], the rows of the KV pool this batch uses. L is taken from the shape of
    ctx_indices, not from comp_ctx_len (QEfficient's current form: a shape-derived size keeps
    the compiler's Expand away from its "non-constant repeats" error); comp_ctx_len stays an
    input for the call's signature."""
    b = _Body("cgb")
    heads = b.dim("data", 1)
    shape = b.op("Concat", b.op("Reshape", b.dim("batch_index", 0), b.ints(1)),
                 b.op("Reshape", heads, b.ints(1)),
                 b.op("Reshape", b.dim("ctx_indices", 2), b.ints(1)), b.ints(1), axis=0)
    parts = [b.op("Expand", b.op("Unsqueeze", "batch_index", b.ints(2, 3)), shape),
             b.op("Expand", b.op("Unsqueeze", b.arange(heads), b.ints(0, 2, 3)), shape),
             b.op("Expand", b.op("Unsqueeze", "ctx_indices", b.ints(3)), shape)]
    b.op("GatherND", "data", b.op("Concat", *parts, axis=3), out="output")
    return _function("CtxGatherCB", ["data", "batch_index", "ctx_indices", "comp_ctx_len"], b)


def custom_rms_norm() -> onnx.FunctionProto:
    """CustomRMSNorm(hidden_states, weight; epsilon) = weight * x / sqrt(mean(x^2, -1) + eps)."""
    b = _Body("rms")
    eps = helper.make_node("Constant", [], ["eps"])
    eps.attribute.append(AttributeProto(name="value_float", ref_attr_name="epsilon",
                                        type=AttributeProto.FLOAT))
    b.nodes.append(eps)
    x = "hidden_states"
    var = b.op("ReduceMean", b.op("Pow", x, b.op("Constant", value_float=2.0)), axes=[-1],
               keepdims=1)
    eps_full = b.op("Expand", "eps", b.op("Shape", var))
    normed = b.op("Mul", x, b.op("Reciprocal", b.op("Sqrt", b.op("Add", var, eps_full))))
    b.op("Mul", b.op("Cast", "weight", to=TensorProto.FLOAT), normed, out="output")
    return _function("CustomRMSNorm", ["hidden_states", "weight"], b, attributes=["epsilon"],
                     domain=AISW)


def _function(name: str, inputs: list[str], body: _Body, attributes: list[str] = (),
              domain: str = CLOUD) -> onnx.FunctionProto:
    return helper.make_function(domain, name, inputs, ["output"], body.nodes,
                                [helper.make_opsetid("", OPSET)], list(attributes))


def onnxruntime_indices(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The invalid-index initializers of a card graph with the values ONNX Runtime accepts
    (module docstring), for SessionOptions.add_initializer or to rewrite the graph."""
    names = {t.name for t in model.graph.initializer}
    return {name: np.array(value, np.int64) for name, value in ONNXRUNTIME_INDICES.items()
            if name in names}


def for_onnxruntime(model: onnx.ModelProto) -> None:
    """Make a copy of a card graph what ONNX Runtime accepts with fixed dims, in place: the
    invalid-index initializers as `onnxruntime_indices` gives them, and each Range in a function
    body fed scalars (QEfficient's bodies hand Range one-element tensors, which ORT's shape
    inference refuses once the dims are known)."""
    values = onnxruntime_indices(model)
    for t in model.graph.initializer:
        if t.name in values:
            t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    for f in model.functions:
        nodes = []
        for n in f.node:
            if n.op_type == "Range":
                axes = f"{n.output[0]}_scalar_axes"
                nodes.append(helper.make_node("Constant", [], [axes], value=helper.make_tensor(
                    "axes", TensorProto.INT64, [1], [0])))
                for i, name in enumerate(list(n.input)):
                    nodes.append(helper.make_node("Squeeze", [name, axes],
                                                  [f"{n.output[0]}_scalar_{i}"]))
                    n.input[i] = f"{n.output[0]}_scalar_{i}"
            nodes.append(n)
        del f.node[:]
        f.node.extend(nodes)


FUNCTIONS = {"CtxScatter": ctx_scatter, "CtxScatterCB": ctx_scatter_cb, "CtxGather": ctx_gather,
             "CtxGatherCB": ctx_gather_cb, "CustomRMSNorm": custom_rms_norm}
FUNCTION_DOMAINS = {"CtxScatter": CLOUD, "CtxScatterCB": CLOUD, "CtxGather": CLOUD,
                    "CtxGatherCB": CLOUD, "CustomRMSNorm": AISW}

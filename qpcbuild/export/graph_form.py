"""The form of a card graph, as `qpcbuild doctor` compares it with QEfficient's exports.

What the Cloud AI compiler sees is more than a list of op types: which attributes each op
carries (`Shape` with or without `start`/`end`), what the bodies of the model-local functions
are made of, and how each function is called (what produces each of its inputs, whether its
output is a graph output). `graph_form` reduces an ONNX model to exactly those facts, as plain
JSON-ready values, so the same code describes QEfficient's graphs (scripts/record_qeff_dialect.py
writes them to tests/fixtures/qefficient_dialect.json) and ours.

This module needs only `onnx`: the recording script loads it by file path in QEfficient's own
virtual environment, where qpcbuild's dependencies are not installed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import onnx
from onnx import AttributeProto, numpy_helper

from . import OPSET


def op_key(node: onnx.NodeProto) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain else node.op_type


def _default(node: onnx.NodeProto, name: str):
    """The schema's default of an attribute (None if it has none): an attribute written with
    its default value is the same form as one left out (torch writes Reshape's allowzero=0)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, OPSET, node.domain or "")
    except onnx.defs.SchemaError:
        return None
    attr = schema.attributes.get(name)
    if attr is None or not attr.default_value.name:
        return None
    return onnx.helper.get_attribute_value(attr.default_value)


def op_form(node: onnx.NodeProto) -> str:
    """`Op[attr=value,...]`: integer attributes with their values (axes, perm, start/end,
    keepdims, Cast's `to`) unless the value is the schema's default, any other attribute by
    name only; a reference to a function attribute as `@name`. Constant nodes keep their
    attribute's name only (value_ints, value_float, value): their values are data, not form."""
    parts = []
    for a in sorted(node.attribute, key=lambda a: a.name):
        if a.type in (AttributeProto.INT, AttributeProto.INTS) and not a.ref_attr_name and \
                onnx.helper.get_attribute_value(a) == _default(node, a.name):
            continue
        if a.ref_attr_name:
            parts.append(f"{a.name}=@{a.ref_attr_name}")
        elif node.op_type != "Constant" and a.type == AttributeProto.INT:
            parts.append(f"{a.name}={a.i}")
        elif node.op_type != "Constant" and a.type == AttributeProto.INTS:
            parts.append(f"{a.name}={','.join(str(v) for v in a.ints)}")
        else:
            parts.append(a.name)
    return op_key(node) + (f"[{','.join(parts)}]" if parts else "")


class _Graph:
    """Producers and small constant values of a model's main graph."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.inputs = {i.name for i in g.input}
        self.outputs = {o.name for o in g.output}
        self.producer = {out: n for n in g.node for out in n.output}
        self.values: dict[str, Any] = {}
        for t in g.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL and _numel(t) <= 16:
                self.values[t.name] = numpy_helper.to_array(t)
        for n in g.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].type == \
                    AttributeProto.TENSOR and _numel(n.attribute[0].t) <= 16:
                self.values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        self.initializers = {t.name for t in g.initializer}

    def scalar(self, name: str) -> int | float | None:
        v = self.values.get(name)
        if v is None or v.size != 1:
            return None
        return v.reshape(-1)[0].item()

    def source(self, name: str) -> str:
        """What produces tensor `name`, as a call-site convention: `graph_input`,
        `initializer`, or the producing op; a Where that picks a constant scalar (an invalid
        index) names that value, `Where(2147483647)`; a Cast names its target type."""
        if name in self.inputs:
            return "graph_input"
        node = self.producer.get(name)
        if node is None:
            return "initializer" if name in self.initializers else "unknown"
        if node.op_type == "Where":
            for branch in node.input[1:]:
                value = self.scalar(branch)
                if isinstance(value, int):
                    return f"Where({value})"
        if node.op_type == "Cast":
            return f"Cast(to={next(a.i for a in node.attribute if a.name == 'to')})"
        return "Constant" if node.op_type == "Constant" else op_key(node)


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n


def graph_form(model: onnx.ModelProto) -> dict[str, Any]:
    """Top-level op forms with counts, and per model-local function its signature, body forms
    and call sites. Plain JSON values; lists sorted so equal graphs give equal forms."""
    g = _Graph(model)
    top: dict[str, Counter] = {}
    for n in model.graph.node:
        top.setdefault(op_key(n), Counter())[op_form(n)] += 1
    functions: dict[str, Any] = {}
    for f in model.functions:
        calls = [n for n in model.graph.node if n.op_type == f.name and n.domain == f.domain]
        functions[f.name] = {
            "domain": f.domain, "inputs": list(f.input), "attributes": list(f.attribute),
            "body": sorted(op_form(n) for n in f.node if n.op_type != "Constant"),
            "body_ops": sorted({n.op_type for n in f.node}),
            "called_with": [sorted({g.source(c.input[i]) for c in calls if i < len(c.input)})
                            for i in range(len(f.input))],
            "output_is_graph_output": sorted({c.output[0] in g.outputs for c in calls}),
        }
    casts_into_matmul = sum(1 for n in model.graph.node if n.op_type == "MatMul"
                            for i in n.input if g.source(i).startswith("Cast(")
                            and g.producer[i].input[0] in g.initializers)
    return {"opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "ir_version": model.ir_version,
            "top_level": {k: dict(sorted(c.items())) for k, c in sorted(top.items())},
            "functions": dict(sorted(functions.items())),
            "casts_of_weights_into_matmul": casts_into_matmul,
            "io_dtypes": {v.name: v.type.tensor_type.elem_type
                          for v in [*model.graph.input, *model.graph.output]}}

"""The fused ONNX Runtime kernels both lowerings build on (ort_graph.py for decoders,
eagle3_graph.py for EAGLE-3 heads): RMSNorm with and without the residual add, and
GroupQueryAttention with the lengths it reads from the call's positions."""

from __future__ import annotations

from typing import NamedTuple

from onnx import TensorProto, helper

from ...export import MS
from ...export.builder import GraphBuilder


def norm(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    """RMSNorm(x) * weight in one kernel (float32 statistics)."""
    return g.op("SimplifiedLayerNormalization", x, weight, axis=-1, epsilon=eps, stash_type=1)


def skip_norm(g: GraphBuilder, x: str, delta: str, weight: str, eps: float,
              summed: str | None = None) -> tuple[str, str]:
    """(norm(x + delta), x + delta) in one kernel; `summed`: the sum's name."""
    normed, summed = g._name("sln"), summed or g._name("residual")
    g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [x, delta, weight],
                                    [normed, "", "", summed], domain=MS,
                                    name=f"n{len(g.nodes)}_SkipSLN", epsilon=eps))
    return normed, summed


class Lengths(NamedTuple):
    seq: str  # [1] the call's tokens per row
    start: str  # [B] each row's first slot
    seqlens: str  # [B] int32 each row's last slot (GroupQueryAttention's seqlens_k)
    total: str  # int32 the longest row's slots (its total_sequence_length)


def attention_lengths(g: GraphBuilder, ids: str, pos: str, ctx_len: int | None = None) -> Lengths:
    """What GroupQueryAttention reads of a call of consecutive positions starting at
    position_ids[:, 0]. `ctx_len`: a row with no real token (all -1) writes its slots at the
    end of that buffer."""
    seq = g.op("Shape", ids, start=1, end=2)  # [1]
    start = g.op("Squeeze", g.op("Slice", pos, g.const([0]), g.const([1]), g.const([1])),
                 g.const([1]))  # [B] first slot's position
    if ctx_len is not None:
        start = g.op("Where", g.op("Less", start, g.const(0)),
                     g.op("Sub", g.const([ctx_len]), seq), start)
    last = g.op("Sub", g.op("Add", start, seq), g.const([1]))
    seqlens = g.op("Cast", last, to=TensorProto.INT32)
    total = g.op("Cast", g.op("ReduceMax", g.op("Add", last, g.const([1])), keepdims=0),
                 to=TensorProto.INT32)
    return Lengths(seq, start, seqlens, total)


def grouped_query_attention(g: GraphBuilder, inputs: list[str], present: list[str],
                            **attrs: object) -> str:
    """com.microsoft.GroupQueryAttention over `inputs` (q, k, v, past K/V, seqlens_k, total, and
    the cos/sin caches when it applies RoPE), writing `present` K/V; its output's name."""
    out = g._name("attn")
    g.nodes.append(helper.make_node("GroupQueryAttention", inputs, [out, *present], domain=MS,
                                    name=f"n{len(g.nodes)}_GQA", **attrs))
    return out

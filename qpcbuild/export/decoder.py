"""The one decoder graph for every supported family, written as plain ONNX (opset 17).

Shapes in comments: B batch, S seq_len, C ctx_len, H hidden, nH/nKV heads, D head_dim,
g = nH / nKV (query heads per KV head), V vocab, N num_logits_to_keep.

Contract (shared/reference/qaic-conventions.md, section 1): KV buffers are fixed-size retained
state written at `position_ids` with ScatterND; the attention mask is derived from positions
(key k is hidden from query q when k > position q), so stale entries past a row's position are
invisible and nothing is ever rolled back; position -1 marks a padded slot.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from onnx import TensorProto

from ..arch import ArchSpec
from .builder import GraphBuilder

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
MASKED = -10000.0  # finite so fully masked pad rows stay finite, and representable in fp16

# load(name, shape) -> graph tensor name of that weight (float32 or float16 + Cast)
WeightLoader = Callable[[str, tuple[int, ...], bool], str]


class Decoder:
    def __init__(self, g: GraphBuilder, arch: ArchSpec, load: WeightLoader):
        self.g, self.a, self.load = g, arch, load

    # ------------------------------------------------------------ small pieces
    def rms_norm(self, x: str, weight: str) -> str:
        g = self.g
        var = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)
        denom = g.op("Sqrt", g.op("Add", var, g.const(self.a.rms_norm_eps, np.float32)))
        return g.op("Mul", g.op("Div", x, denom), weight)

    def linear(self, x: str, prefix: str, n_in: int, n_out: int, bias: bool) -> str:
        y = self.g.op("MatMul", x, self.load(f"{prefix}.weight", (n_out, n_in), True))
        return self.g.op("Add", y, self.load(f"{prefix}.bias", (n_out,), False)) if bias else y

    def rope(self, x: str, cos: str, sin: str) -> str:
        g, half = self.g, self.a.head_dim // 2
        x1, x2 = g.op("Split", x, g.const([half, half]), axis=-1, n_out=2)
        rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))

    def heads(self, x: str, n: int) -> str:
        """[B,S,n*D] -> [B,n,S,D]"""
        g = self.g
        x = g.op("Reshape", x, g.const([0, 0, n, self.a.head_dim]))
        return g.op("Transpose", x, perm=[0, 2, 1, 3])

    # ------------------------------------------------------------ the graph
    def build(self, role: str, continuous_batching: bool) -> None:
        g, a = self.g, self.a
        kv_batch = "full_batch_size" if continuous_batching else "batch_size"
        kv_shape = [kv_batch, a.num_kv_heads, "ctx_len", a.head_dim]
        ids = g.input("input_ids", INT64, ["batch_size", "seq_len"])
        pos = g.input("position_ids", INT64, ["batch_size", "seq_len"])
        batch_index = g.input("batch_index", INT64, ["batch_size", 1]) if continuous_batching \
            else None
        past = [(g.input(f"past_key.{i}", FLOAT, kv_shape), g.input(f"past_value.{i}", FLOAT,
                 kv_shape)) for i in range(a.num_layers)]
        nlk_input = g.input("num_logits_to_keep", INT64, ["num_logits_to_keep", 1]) \
            if role == "target" else None

        batch = g.op("Shape", ids, start=0, end=1)  # [1] = B
        seq = g.op("Shape", ids, start=1, end=2)  # [1] = S
        ctx = g.op("Shape", past[0][0], start=2, end=3)  # [1] = C

        # RoPE angles straight from positions: no table, so no max-position limit.
        freqs = g.op("Mul", g.op("Unsqueeze", g.op("Cast", pos, to=FLOAT), g.const([-1])),
                     g.const(a.inv_freq(), np.float32))  # [B,S,D/2]
        emb = g.op("Concat", freqs, freqs, axis=-1)  # [B,S,D]
        cos = g.op("Unsqueeze", g.op("Cos", emb), g.const([1]))  # [B,1,S,D]
        sin = g.op("Unsqueeze", g.op("Sin", emb), g.const([1]))

        # Mask [B,1,1,S,C]: key k hidden from query q when k > position of q.
        keys = g.op("Range", g.const(0), g.op("Squeeze", ctx, g.const([0])), g.const(1))  # [C]
        mask = g.op("Greater", keys, g.op("Unsqueeze", pos, g.const([-1])))  # [B,S,C]
        mask = g.op("Unsqueeze", mask, g.const([1, 2]))

        # ScatterND indices [B,nKV,S,3] = (row, kv head, slot); pads (-1) go to slot C-1.
        last_slot = g.op("Sub", ctx, g.const([1]))
        slot = g.op("Where", g.op("Less", pos, g.const(0)), last_slot, pos)  # [B,S]
        expand_to = g.op("Concat", batch, g.const([a.num_kv_heads]), seq, axis=0)
        if batch_index is not None:
            rows = g.op("Reshape", batch_index, g.const([-1, 1, 1]))
        else:
            rows = g.op("Reshape", g.op("Range", g.const(0), g.op("Squeeze", batch,
                        g.const([0])), g.const(1)), g.const([-1, 1, 1]))
        head_ids = g.const(np.arange(a.num_kv_heads).reshape(1, -1, 1))
        parts = [g.op("Unsqueeze", g.op("Expand", t, expand_to), g.const([-1]))
                 for t in (rows, head_ids, g.op("Unsqueeze", slot, g.const([1])))]
        scatter_idx = g.op("Concat", *parts, axis=-1)
        gather_rows = g.op("Reshape", batch_index, g.const([-1])) if batch_index is not None \
            else None

        x = g.op("Gather", self.load("model.embed_tokens.weight",
                                     (a.vocab_size, a.hidden_size), False), ids)  # [B,S,H]
        for i in range(a.num_layers):
            x = self.layer(i, x, cos, sin, mask, scatter_idx, past[i], gather_rows)
        x = self.rms_norm(x, self.load("model.norm.weight", (a.hidden_size,), False))
        self.head(x, pos, nlk_input)
        for i in range(a.num_layers):
            for kind in ("key", "value"):
                g.output(f"past_{kind}.{i}_RetainedState", FLOAT, kv_shape)

    def layer(self, i: int, x: str, cos: str, sin: str, mask: str, scatter_idx: str,
              past: tuple[str, str], gather_rows: str | None) -> str:
        g, a = self.g, self.a
        p = f"model.layers.{i}"
        h, d, nh, nkv = a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads
        n = self.rms_norm(x, self.load(f"{p}.input_layernorm.weight", (h,), False))
        q = self.heads(self.linear(n, f"{p}.self_attn.q_proj", h, nh * d, a.qkv_bias), nh)
        k = self.heads(self.linear(n, f"{p}.self_attn.k_proj", h, nkv * d, a.qkv_bias), nkv)
        v = self.heads(self.linear(n, f"{p}.self_attn.v_proj", h, nkv * d, a.qkv_bias), nkv)
        if a.qk_norm:
            q = self.rms_norm(q, self.load(f"{p}.self_attn.q_norm.weight", (d,), False))
            k = self.rms_norm(k, self.load(f"{p}.self_attn.k_norm.weight", (d,), False))
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)  # [B,n,S,D]

        k_all = g.op("ScatterND", past[0], scatter_idx, k, out=f"past_key.{i}_RetainedState")
        v_all = g.op("ScatterND", past[1], scatter_idx, v, out=f"past_value.{i}_RetainedState")
        if gather_rows is not None:  # continuous batching: this batch's rows of the KV pool
            k_all = g.op("Gather", k_all, gather_rows, axis=0)
            v_all = g.op("Gather", v_all, gather_rows, axis=0)

        # Grouped-query attention without copying KV: q [B,nKV,g,S,D] against k [B,nKV,1,C,D].
        q5 = g.op("Reshape", q, g.const([0, nkv, nh // nkv, -1, d]))
        k5 = g.op("Unsqueeze", k_all, g.const([2]))
        v5 = g.op("Unsqueeze", v_all, g.const([2]))
        scores = g.op("MatMul", q5, g.op("Transpose", k5, perm=[0, 1, 2, 4, 3]))  # [B,nKV,g,S,C]
        scores = g.op("Mul", scores, g.const(d ** -0.5, np.float32))
        scores = g.op("Where", mask, g.const(MASKED, np.float32), scores)
        attn = g.op("MatMul", g.op("Softmax", scores, axis=-1), v5)  # [B,nKV,g,S,D]
        attn = g.op("Reshape", attn, g.const([0, nh, -1, d]))
        attn = g.op("Reshape", g.op("Transpose", attn, perm=[0, 2, 1, 3]), g.const([0, 0, nh * d]))
        x = g.op("Add", x, self.linear(attn, f"{p}.self_attn.o_proj", nh * d, h, a.o_bias))

        n = self.rms_norm(x, self.load(f"{p}.post_attention_layernorm.weight", (h,), False))
        gate = self.linear(n, f"{p}.mlp.gate_proj", h, a.intermediate_size, a.mlp_bias)
        up = self.linear(n, f"{p}.mlp.up_proj", h, a.intermediate_size, a.mlp_bias)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)  # SiLU(gate) * up
        return g.op("Add", x, self.linear(act, f"{p}.mlp.down_proj", a.intermediate_size, h,
                                          a.mlp_bias))

    def head(self, x: str, pos: str, nlk_input: str | None) -> None:
        a = self.a
        if a.tie_word_embeddings:
            lm = self.g.op("Transpose", self.load("model.embed_tokens.weight",
                                                  (a.vocab_size, a.hidden_size), False), perm=[1, 0])
        else:
            lm = self.load("lm_head.weight", (a.vocab_size, a.hidden_size), True)
        logits_head(self.g, x, pos, nlk_input, lm, a, "batch_size")


def logits_head(g: GraphBuilder, x: str, pos: str, nlk_input: str | None, lm: str | None,
                a: ArchSpec, batch_dim, matmul=None) -> None:
    """Logits for the last real token (draft) or the N tokens ending there (target).
    `matmul(x, out)` replaces the plain MatMul by `lm` (a lowering's quantized kernel)."""
    last = g.op("ArgMax", pos, axis=1, keepdims=1)  # [B,1] index of the largest position
    if nlk_input is None:
        rows = last
    else:
        n = g.op("Shape", nlk_input, start=0, end=1)
        first = g.op("Max", g.op("Add", g.op("Sub", last, n), g.const([[1]])), g.const([[0]]))
        span = g.op("Range", g.const(0), g.op("Squeeze", n, g.const([0])), g.const(1))
        seq_last = g.op("Sub", g.op("Shape", pos, start=1, end=2), g.const([1]))
        rows = g.op("Min", g.op("Add", first, g.op("Unsqueeze", span, g.const([0]))),
                    seq_last)  # [B,N]
    shape = g.op("Concat", g.op("Shape", rows), g.const([a.hidden_size]), axis=0)
    picked = g.op("GatherElements", x, g.op("Expand", g.op("Unsqueeze", rows, g.const([-1])),
                                             shape), axis=1)  # [B,N,H]
    if matmul is None:
        g.op("MatMul", picked, lm, out="logits")
    else:
        matmul(picked, "logits")
    g.output("logits", FLOAT, [batch_dim, "num_logits_to_keep" if nlk_input else 1,
                               a.vocab_size])

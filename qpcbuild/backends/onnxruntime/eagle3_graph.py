"""The ONNX Runtime lowering of an EAGLE-3 head (export/eagle3.py has the portable form): the same
layer and outputs on the fused kernels the target's lowering uses (ort_graph.py), with the head's
cache kept in place.

A head call is one token most of the time, so what it costs is its kernels' count and what it
reads, not its arithmetic: the portable form spells RMSNorm, RoPE, the mask and attention as some
hundred small operators and receives its whole cache as an input each call, to concatenate it
with the call's keys. Here the norms are (Skip)SimplifiedLayerNormalization, q/k/v and gate/up
are one projection each on concatenated weights, and attention is
com.microsoft.GroupQueryAttention with RoPE inside, reading and writing `past_key` / `past_value`
[B, nKV, cache_len, D] in place (the runtime binds each of them and its `_RetainedState`
output to one buffer, as for the target). The call's tokens sit at `position_ids` start..start+n-1
after the positions 0..start-1 the cache holds; anything a rejected draft left beyond them is
never read (the kernel reads a row's first start + n slots) and is overwritten by the next call
that reaches it.

The graph holds no token embedding: its input `inputs_embeds` [B, n, H] is the rows of the
target's own (TARGET_EMBEDDING in the target's artifact, which the runtime maps from its file),
where the portable form carries a copy and takes `input_ids` (113 MB for SmolLM2-135M, 933 MB
for a 152k x 1536 vocabulary). Its other inputs are `hidden`, `position_ids`, `past_key` and
`past_value`; outputs `logits` [B, n, Vd], `hidden_out` [B, n, H] (before the final norm), the
two `_RetainedState` buffers and `draft_to_target` [Vd], as the portable form names them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from onnx import TensorProto, helper

from ...export import DATA_FILE, GRAPH_FILE, MS, OPSET, TARGET_EMBEDDING
from ...export.builder import GraphBuilder, save
from ...export.eagle3 import head_info_metadata
from ...export.eagle3_card import head_arch
from ...models.eagle3_head import LAYER, Eagle3Head, Eagle3HeadInfo
from .fused_ops import attention_lengths, grouped_query_attention, norm, skip_norm
from .ort_graph import rope_tables

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
HEAD_GRAPH = "fused"  # the head graph's form, in its metadata and its cache key
GQA_HEAD_DIM = 16  # GroupQueryAttention's CPU kernel takes head_dim in multiples of this
# project(g, x, name, w [K, N], out) -> x @ w in the head's weight format
Projection = Callable[[GraphBuilder, str, str, np.ndarray, "str | None"], str]


def fits_fused(info: Eagle3HeadInfo) -> bool:
    """Whether the head can run on the fused kernels (else its portable form is built)."""
    return info.head_dim % GQA_HEAD_DIM == 0


def build_fused_head(g: GraphBuilder, head: Eagle3Head, max_positions: int,
                     project: Projection) -> None:
    i, w = head.info, head.weights
    h, d, nh, nkv, eps = i.hidden_size, i.head_dim, i.num_heads, i.num_kv_heads, i.rms_norm_eps
    emb = g.input("inputs_embeds", FLOAT, ["batch_size", "seq_len", h])
    hidden = g.input("hidden", FLOAT, ["batch_size", "seq_len", h])
    pos = g.input("position_ids", INT64, ["batch_size", "seq_len"])
    past_k = g.input("past_key", FLOAT, ["batch_size", nkv, "cache_len", d])
    past_v = g.input("past_value", FLOAT, ["batch_size", nkv, "cache_len", d])

    def weight(name: str) -> str:
        return g.weight(name, w[name])

    def linear(x: str, names: list[str], key: str, out: str | None = None) -> str:
        """x @ [W1^T | W2^T | ...]: one projection for weights that read the same input."""
        return project(g, x, key, np.concatenate([w[n].T for n in names], axis=1), out)

    _, _, seqlens, total = attention_lengths(g, pos, pos)  # (pos has the call's shape)
    normed_h = norm(g, hidden, weight(f"{LAYER}.hidden_norm.weight"), eps)
    z = g.op("Concat", norm(g, emb, weight(f"{LAYER}.input_layernorm.weight"), eps), normed_h,
             axis=-1)  # [B,n,2H]: q/k/v read the token and the feature side by side
    p = f"{LAYER}.self_attn"
    qkv = linear(z, [f"{p}.{n}_proj.weight" for n in ("q", "k", "v")], f"{p}.qkv^T")
    q, k, v = g.op("Split", qkv, g.const([nh * d, nkv * d, nkv * d]), axis=-1, n_out=3)
    cos, sin = rope_tables(head_arch(i, max_positions), max_positions)  # the target's kind
    attn = grouped_query_attention(
        g, [q, k, v, past_k, past_v, seqlens, total, g.weight("rope_cos", cos),
            g.weight("rope_sin", sin)], ["past_key_RetainedState", "past_value_RetainedState"],
        num_heads=nh, kv_num_heads=nkv, do_rotary=1, rotary_interleaved=0,
        scale=float(1.0 / np.sqrt(d)))
    o = linear(attn, [f"{p}.o_proj.weight"], f"{p}.o_proj.weight^T")
    residual = normed_h if i.norm_before_residual else hidden
    n, x = skip_norm(g, residual, o, weight(f"{LAYER}.post_attention_layernorm.weight"), eps)
    m = f"{LAYER}.mlp"
    gate, up = g.op("Split", linear(n, [f"{m}.gate_proj.weight", f"{m}.up_proj.weight"],
                                    f"{m}.gate_up^T"),
                    g.const([i.intermediate_size] * 2), axis=-1, n_out=2)
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    down = linear(act, [f"{m}.down_proj.weight"], f"{m}.down_proj.weight^T")
    final, _ = skip_norm(g, x, down, weight("norm.weight"), eps, summed="hidden_out")
    linear(final, ["lm_head.weight"], "lm_head.weight^T", out="logits")
    g.output("logits", FLOAT, ["batch_size", "seq_len", i.draft_vocab_size])
    g.output("hidden_out", FLOAT, ["batch_size", "seq_len", h])
    for name in ("past_key_RetainedState", "past_value_RetainedState"):
        g.output(name, FLOAT, ["batch_size", nkv, "cache_len", d])
    g.op("Identity", g.const(head.draft_to_target), out="draft_to_target")
    g.output("draft_to_target", INT64, [i.draft_vocab_size])


def export_fused_head(head: Eagle3Head, max_positions: int, out_dir: Path, project: Projection,
                      weights: str) -> Path:
    """Write `out_dir/model.onnx` + `model.onnx.data` of the fused head graph; its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / DATA_FILE, "wb") as data:
        g = GraphBuilder(data, DATA_FILE)
        build_fused_head(g, head, max_positions, project)
    metadata = {**head_info_metadata(head.info), "graph": HEAD_GRAPH, "weights": weights,
                "inputs_embeds": TARGET_EMBEDDING}
    model = g.model("qpcbuild_eagle3_head_ort", OPSET, metadata)
    model.opset_import.append(helper.make_opsetid(MS, 1))
    save(model, out_dir / GRAPH_FILE)
    return out_dir / GRAPH_FILE

"""EAGLE-3 draft heads as ONNX (models/eagle3_head.py reads them): the target's feature output and
the head's own graph.

Feature: the target also returns, for every position of a call, fc(concat of the hidden states
entering the head's auxiliary layers) [B, S, H]. `fc` is baked into the target's graph, so the
head graph always takes an H-wide hidden, whether it comes from the target (a verified position)
or from the head's own previous step (a drafted one); the feature crossing to the host is H wide
instead of 3H.

Head graph (plain ONNX operators, run by ONNX Runtime): one call embeds `input_ids` [B, n] with
the target's token embedding (a copy in the head's file), pairs them with `hidden` [B, n, H] at
`position_ids` [B, n] (consecutive, after the P cached positions), and attends over `past_key` /
`past_value` [B, nKV, P, D] (positions 0..P-1) and its own n keys, causally. Outputs: `logits`
[B, n, Vd] over the draft vocabulary, `hidden_out` [B, n, H] (the layer's output before the final
norm: the next step's hidden), `key` / `value` [B, nKV, n, D], which the runtime writes into
its cache at those positions, and `draft_to_target` [Vd] (d2t as target ids, a constant). Stale
positions past a row's accepted prefix are simply overwritten by the next call that reaches them
(the cache given is always 0..P-1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from onnx import TensorProto, helper

from . import DATA_FILE, GRAPH_FILE, MS, OPSET
from ..models.eagle3_head import LAYER, Eagle3Head, Eagle3HeadInfo
from .builder import GraphBuilder, save

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
FEATURE_OUTPUT = "eagle3_hidden"  # the target graph's extra output [B, S, H]
FC_WEIGHT = "eagle3.fc.weight^T"  # [n*H, H] in the target's graph
# project(g, x, name, w [K, N], out) -> x @ w in some weight format (the ONNX Runtime backend
# passes its MatMulNBits form for int8/int4 heads); None: a float32 MatMul
Projection = Callable[[GraphBuilder, str, str, np.ndarray, "str | None"], str]


def feature_output(g: GraphBuilder, aux: list[str], fc_t: str) -> None:
    """The target's `eagle3_hidden` [B, S, H] from its auxiliary hidden states (each [B, S, H],
    in the head's layer order) and fc^T [n*H, H]."""
    joined = g.op("Concat", *aux, axis=-1) if len(aux) > 1 else aux[0]
    g.op("MatMul", joined, fc_t, out=FEATURE_OUTPUT)


class HeadGraph:
    """Builds the head graph into `g` from the head's weights and the target's embedding."""

    def __init__(self, g: GraphBuilder, head: Eagle3Head, embed: np.ndarray,
                 max_positions: int, project: Projection | None = None):
        self.g, self.i, self.w, self.d2t = g, head.info, head.weights, head.draft_to_target
        self.embed, self.max_positions, self.project = embed, max_positions, project

    def norm(self, x: str, name: str) -> str:
        g = self.g
        var = g.op("ReduceMean", g.op("Mul", x, x), axes=[-1], keepdims=1)
        scale = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(self.i.rms_norm_eps,
                                                                           np.float32))))
        return g.op("Mul", g.op("Mul", x, scale), g.weight(name, self.w[name]))

    def linear(self, x: str, name: str, out: str | None = None) -> str:
        if self.project is not None:
            return self.project(self.g, x, f"{name}^T", self.w[name].T, out)
        return self.g.op("MatMul", x, self.g.weight(f"{name}^T", self.w[name].T), out=out)

    def split_heads(self, x: str, n: int) -> str:
        g = self.g
        return g.op("Transpose", g.op("Reshape", x, g.const([0, 0, n, self.i.head_dim])),
                    perm=[0, 2, 1, 3])

    def rope(self, x: str, cos: str, sin: str) -> str:
        g, half = self.g, self.i.head_dim // 2
        x1 = g.op("Slice", x, g.const([0]), g.const([half]), g.const([-1]))
        x2 = g.op("Slice", x, g.const([half]), g.const([2 * half]), g.const([-1]))
        rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))

    def rope_tables(self) -> tuple[np.ndarray, np.ndarray]:
        d = self.i.head_dim
        inv = 1.0 / (self.i.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        freqs = np.outer(np.arange(self.max_positions, dtype=np.float32), inv.astype(np.float32))
        emb = np.concatenate([freqs, freqs], axis=-1)
        return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)

    def build(self) -> None:
        g, i = self.g, self.i
        h, d, nh, nkv = i.hidden_size, i.head_dim, i.num_heads, i.num_kv_heads
        ids = g.input("input_ids", INT64, ["batch_size", "seq_len"])
        hidden = g.input("hidden", FLOAT, ["batch_size", "seq_len", h])
        pos = g.input("position_ids", INT64, ["batch_size", "seq_len"])
        past_k = g.input("past_key", FLOAT, ["batch_size", nkv, "past_len", d])
        past_v = g.input("past_value", FLOAT, ["batch_size", nkv, "past_len", d])

        emb = g.op("Gather", g.weight("embed_tokens.weight", self.embed), ids)  # [B,n,H]
        normed_h = self.norm(hidden, f"{LAYER}.hidden_norm.weight")
        z = g.op("Concat", self.norm(emb, f"{LAYER}.input_layernorm.weight"), normed_h, axis=-1)
        residual = normed_h if i.norm_before_residual else hidden
        p = f"{LAYER}.self_attn"
        q = self.split_heads(self.linear(z, f"{p}.q_proj.weight"), nh)  # [B,nH,n,D]
        k = self.split_heads(self.linear(z, f"{p}.k_proj.weight"), nkv)
        v = self.split_heads(self.linear(z, f"{p}.v_proj.weight"), nkv)
        cos_t, sin_t = self.rope_tables()
        cos, sin = (g.op("Unsqueeze", g.op("Gather", g.weight(name, t), pos), g.const([1]))
                    for name, t in (("rope.cos", cos_t), ("rope.sin", sin_t)))  # [B,1,n,D]
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        g.op("Identity", k, out="key")
        g.op("Identity", v, out="value")
        keys = g.op("Concat", past_k, k, axis=2)  # [B,nKV,P+n,D]
        values = g.op("Concat", past_v, v, axis=2)
        if nh != nkv:  # each KV head serves its group of query heads
            keys, values = (self.repeat(t, nh // nkv) for t in (keys, values))
        scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2])),
                      g.const(1.0 / np.sqrt(d), np.float32))  # [B,nH,n,P+n]
        scores = g.op("Where", self.hidden_keys(past_k, pos), g.const(-1e9, np.float32), scores)
        attn = g.op("MatMul", g.op("Softmax", scores, axis=-1), values)  # [B,nH,n,D]
        attn = g.op("Reshape", g.op("Transpose", attn, perm=[0, 2, 1, 3]), g.const([0, 0, nh * d]))
        x = g.op("Add", residual, self.linear(attn, f"{p}.o_proj.weight"))
        n = self.norm(x, f"{LAYER}.post_attention_layernorm.weight")
        gate = self.linear(n, f"{LAYER}.mlp.gate_proj.weight")
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)),
                   self.linear(n, f"{LAYER}.mlp.up_proj.weight"))
        out = g.op("Add", x, self.linear(act, f"{LAYER}.mlp.down_proj.weight"),
                   out="hidden_out")
        self.linear(self.norm(out, "norm.weight"), "lm_head.weight", out="logits")
        g.output("logits", FLOAT, ["batch_size", "seq_len", i.draft_vocab_size])
        g.output("hidden_out", FLOAT, ["batch_size", "seq_len", h])
        g.output("key", FLOAT, ["batch_size", nkv, "seq_len", d])
        g.output("value", FLOAT, ["batch_size", nkv, "seq_len", d])
        g.op("Identity", g.const(self.d2t), out="draft_to_target")
        g.output("draft_to_target", INT64, [i.draft_vocab_size])

    def repeat(self, kv: str, groups: int) -> str:
        """[B,nKV,T,D] -> [B,nKV*groups,T,D], each KV head repeated for its query heads."""
        g, i = self.g, self.i
        x = g.op("Unsqueeze", kv, g.const([2]))
        x = g.op("Tile", x, g.const([1, 1, groups, 1, 1]))
        return g.op("Reshape", x, g.const([0, i.num_heads, -1, i.head_dim]))

    def hidden_keys(self, past_k: str, pos: str) -> str:
        """[B,1,n,P+n] true where a key sits at a later position than the query: the cache holds
        positions 0..P-1, the call's own keys the given positions."""
        g = self.g
        past_len = g.op("Gather", g.op("Shape", past_k), g.const(2))
        cached = g.op("Range", g.const(0), past_len, g.const(1))  # [P]
        batch = g.op("Gather", g.op("Shape", pos), g.const([0]))
        cached = g.op("Expand", g.op("Unsqueeze", cached, g.const([0])),
                      g.op("Concat", batch, g.op("Unsqueeze", past_len, g.const([0])), axis=0))
        key_pos = g.op("Concat", cached, pos, axis=1)  # [B,P+n]
        later = g.op("Greater", g.op("Unsqueeze", key_pos, g.const([1])),
                     g.op("Unsqueeze", pos, g.const([2])))  # [B,n,P+n]
        return g.op("Unsqueeze", later, g.const([1]))


def head_info_metadata(info: Eagle3HeadInfo) -> dict[str, str]:
    """The head graph's metadata: what the runtime checks the graph against."""
    return {"role": "eagle3_head", "eagle3_head": info.sha256,
            "draft_vocab_size": str(info.draft_vocab_size), "hidden_size": str(info.hidden_size),
            "num_kv_heads": str(info.num_kv_heads), "head_dim": str(info.head_dim)}


def export_head(head: Eagle3Head, embed: np.ndarray, max_positions: int, out_dir: Path,
                project: Projection | None = None, weights: str = "float32") -> Path:
    """Write `out_dir/model.onnx` + `model.onnx.data` of the head graph; the graph's path.
    project/weights: the projections' form and its name (the graph's metadata says it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / DATA_FILE, "wb") as data:
        g = GraphBuilder(data, DATA_FILE)
        HeadGraph(g, head, embed, max_positions, project).build()
    metadata = head_info_metadata(head.info)
    if weights != "float32":  # (only then: a float32 head's graph is as before)
        metadata["weights"] = weights
    model = g.model("qpcbuild_eagle3_head", OPSET, metadata)
    if project is not None:
        model.opset_import.append(helper.make_opsetid(MS, 1))
    save(model, out_dir / GRAPH_FILE)
    return out_dir / GRAPH_FILE

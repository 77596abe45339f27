"""The one decoder graph for every supported family, in QEfficient's dialect (opset 17).

Shapes in comments: B batch, S seq_len, C ctx_len, H hidden, nH/nKV heads, D head_dim,
g = nH / nKV (query heads per KV head), V vocab, N num_logits_to_keep, P max positions.

Contract (docs/graph.md): KV buffers are fixed-size retained state written
at `position_ids`; the attention mask is derived from positions (key k is hidden from query q when
k > position q), so stale entries past a row's position are invisible and nothing is ever rolled
back; position -1 marks a padded slot. The card graph speaks the op vocabulary the Cloud AI
compiler knows from QEfficient (see dialect.py): CtxScatter / CtxGather for the KV cache,
CustomRMSNorm, RoPE read from cos/sin tables, KV heads repeated for grouped-query attention and
an lm_head that is a MatMul weight of its own.

Sliding-window layers (Mistral, Gemma 2/3) keep the same ctx_len-long buffer as full layers, and
their mask also hides key k from query q when k <= position q - window. The mask comes from
positions alone, so a rejected verify window, stale slots and continuous batching behave as in a
full layer; a ring buffer of `window` slots would save memory but its slots would be overwritten
by a window that is then rejected (the keys just behind it would be lost) and every row would need
its own wrap-around, so it is not worth it at the context lengths a card serves.
"""
# Over 400 lines: one graph for every family, with its logits head and the draft heads' outputs
# (turbo's stack, EAGLE-3's features) that read the same hidden states.

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ..models.arch import ArchSpec
from ..models.graph_io import declare, graph_io
from . import dialect
from .dialect import INT32_MAX, INVALID_GATHER_INDEX, INVALID_SCATTER_INDEX
from .builder import GraphBuilder
from .experts import RoutedExperts
from .eagle3 import FC_WEIGHT, Eagle3Head, feature_output
from .turbo import TurboGraph, TurboHeads, turbo_stack, write_turbo_weights

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
VOCAB_SUBSET = "lm_head.vocab_subset"  # [Vs, 1] int64: a draft's kept token ids (ORT lowering)
SUBSET_COLUMN = "lm_head.vocab_subset.column"  # [1, V] int64: each token's column in the subset
SUBSET_KEPT = "lm_head.vocab_subset.kept"  # [V] bool: whether the subset keeps the token
MASKED = -10000.0  # finite so fully masked pad rows stay finite, and representable in fp16

# load(name, shape, transpose[, rows][, offset]) -> graph tensor name of that weight (float32 or
# float16 + Cast); rows: keep only these rows (a draft's vocabulary subset); offset: added to
# every value (Gemma's norms scale by 1 + w)
WeightLoader = Callable[..., str]


def rope_tables(arch: ArchSpec, positions: int,
                local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [positions, D] as transformers computes them: float32 angles pos * inv_freq,
    the half-dimension repeated (rotate_half layout); `local`: the sliding layers' base."""
    freqs = np.outer(np.arange(positions, dtype=np.float32), arch.inv_freq(local))
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    factor = np.float32(arch.rope_attention_factor)  # longrope scales both (float32, as HF)
    return (cos * factor, sin * factor) if factor != 1.0 else (cos, sin)


class Decoder(RoutedExperts):
    def __init__(self, g: GraphBuilder, arch: ArchSpec, load: WeightLoader,
                 vocab_subset: np.ndarray | None = None, moe_op: bool = False,
                 turbo: TurboHeads | None = None, eagle3: Eagle3Head | None = None):
        """moe_op: routed layers on ONNX Runtime's MoE operator (experts.py), not the card's
        dense form. turbo: heads compiled into a target's logits (turbo.py). eagle3: the
        head's feature output (eagle3.py)."""
        self.g, self.a, self.load, self.vocab_subset = g, arch, load, vocab_subset
        self.moe_op, self.turbo, self.eagle3 = moe_op, turbo, eagle3

    # ------------------------------------------------------------ small pieces
    def rms_norm(self, x: str, weight: str) -> str:
        return self.g.call(dialect.custom_rms_norm(), x, weight, epsilon=self.a.rms_norm_eps)

    def norm(self, x: str, name: str, size: int) -> str:
        """RMSNorm by the checkpoint's weight `name`: scaled by w, or by (1 + w) for Gemma,
        whose checkpoints store w - 1 (added while exporting: the norm's weight stays an
        initializer, as CustomRMSNorm takes it in QEfficient's graphs)."""
        return self.rms_norm(x, self.load(name, (size,), False, offset=self.a.norm_offset))

    def activation(self, gate: str) -> str:
        """The gated MLP's activation: SiLU, or GELU's tanh form (Gemma's gelu_pytorch_tanh,
        opset 17 has no Gelu): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
        g = self.g
        if self.a.hidden_act == "silu":
            return g.op("Mul", gate, g.op("Sigmoid", gate))
        f = lambda v: g.const(v, np.float32)  # noqa: E731
        cube = g.op("Mul", g.op("Mul", gate, gate), gate)
        inner = g.op("Mul", g.op("Add", gate, g.op("Mul", cube, f(0.044715))),
                     f(float(np.sqrt(2.0 / np.pi))))
        return g.op("Mul", g.op("Mul", gate, f(0.5)), g.op("Add", g.op("Tanh", inner), f(1.0)))

    def linear(self, x: str, prefix: str, n_in: int, n_out: int, bias: bool) -> str:
        y = self.g.op("MatMul", x, self.load(f"{prefix}.weight", (n_out, n_in), True))
        return self.g.op("Add", y, self.load(f"{prefix}.bias", (n_out,), False)) if bias else y

    def rope(self, x: str, cos: str, sin: str) -> str:
        g, d, r = self.g, self.a.head_dim, self.a.rope_dim
        passed = None
        if r != d:  # partial rotary (Phi-3): the first r dimensions rotate, the rest pass
            passed = self.slice_last(x, r, d)
            x = self.slice_last(x, 0, r)
        # rotate_half's two halves as Slices, the form of QEfficient's export
        x1, x2 = self.slice_last(x, 0, r // 2), self.slice_last(x, r // 2, r)
        rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        out = g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))
        return out if passed is None else g.op("Concat", out, passed, axis=-1)

    def slice_last(self, x: str, start: int, end: int) -> str:
        g = self.g
        return g.op("Slice", x, g.const([start]), g.const([end]), g.const([-1]))

    def projections(self, x: str, prefix: str, sizes: dict[str, int], fused: str | None,
                    bias: bool, then: Sequence[Callable[[str], str]] | None = None) -> list[str]:
        """One linear per name in `sizes`, or (Phi-3) one linear of the fused weight `fused`
        whose output is sliced in that order. `then`: one function per output, applied as soon
        as that output exists, so each projection's own nodes follow its MatMul (the node order
        of the graphs exported before fused projections: their bytes, and so bundle ids, stay)."""
        n_in = self.a.hidden_size
        then = then or [lambda y: y] * len(sizes)
        if fused is None:
            return [f(self.linear(x, f"{prefix}.{name}", n_in, size, bias))
                    for (name, size), f in zip(sizes.items(), then)]
        y = self.linear(x, f"{prefix}.{fused}", n_in, sum(sizes.values()), bias)
        bounds = np.cumsum([0, *sizes.values()])
        return [f(self.slice_last(y, int(a), int(b)))
                for a, b, f in zip(bounds[:-1], bounds[1:], then)]

    def heads(self, x: str, n: int, norm: str | None = None) -> str:
        """[B,S,n*D] -> [B,n,S,D]; `norm`: a per-head RMSNorm weight (Qwen3's q/k norm),
        applied before the Transpose as QEfficient's export does."""
        g = self.g
        x = g.op("Reshape", x, g.const([0, 0, n, self.a.head_dim]))
        if norm is not None:
            x = self.norm(x, norm, self.a.head_dim)
        return g.op("Transpose", x, perm=[0, 2, 1, 3])

    def repeat_kv(self, kv: str, ctx: str) -> str:
        """[B,nKV,C,D] -> [B,nH,C,D]: each KV head repeated for its g query heads."""
        g, a = self.g, self.a
        groups = a.num_heads // a.num_kv_heads
        if groups == 1:
            return kv
        shape = g.op("Concat", dim(g, kv, 0), g.const([a.num_kv_heads, groups]), ctx,
                     g.const([a.head_dim]), axis=0)
        x = g.op("Expand", g.op("Unsqueeze", kv, g.const([2])), shape)  # [B,nKV,g,C,D]
        return g.op("Reshape", x, g.const([0, a.num_heads, -1, a.head_dim]))

    # ------------------------------------------------------------ the graph
    def build(self, role: str, continuous_batching: bool) -> None:
        g, a = self.g, self.a
        io = graph_io(role, a, continuous_batching, self.turbo.info.num_heads if self.turbo else 0,
                      eagle3_features=self.eagle3 is not None)
        given = declare(g, io["inputs"], output=False)
        ids, pos = given["input_ids"], given["position_ids"]
        batch_index = given.get("batch_index")
        past = [(given[f"past_key.{i}"], given[f"past_value.{i}"]) for i in range(a.num_layers)]
        nlk_input = given.get("num_logits_to_keep")

        ctx_len, ctx = self.cache_length(past[0][0])

        rope = {False: self.rope_at(pos, "rope")}  # (cos, sin), each [B,1,S,D]
        if a.has_local_rope:  # Gemma 3's sliding layers: a base of their own
            rope[True] = self.rope_at(pos, "rope.local", local=True)
        masks, kv = self.cache_access(pos, batch_index, ctx_len,
                                      any(a.is_sliding(i) for i in range(a.num_layers)))

        x = g.op("Gather", self.load("model.embed_tokens.weight",
                                     (a.vocab_size, a.hidden_size), False), ids)  # [B,S,H]
        x = self.scaled(x, a.embedding_scale)  # Gemma: rows times sqrt(H); Granite's multiplier
        aux: dict[int, str] = {}  # an EAGLE-3 head's inputs: the states entering its layers
        for i in range(a.num_layers):
            aux[i] = x
            sliding = a.is_sliding(i)
            cos, sin = rope[sliding and a.has_local_rope]
            x = self.layer(i, x, cos, sin, masks[sliding], kv, past[i], ctx)
        x = self.norm(x, "model.norm.weight", a.hidden_size)
        self.head(x, pos, nlk_input)
        if self.eagle3 is not None:
            feature_output(g, [aux[i] for i in self.eagle3.info.aux_layer_ids],
                           g.weight(FC_WEIGHT, self.eagle3.weights["fc.weight"].T))
        declare(g, io["outputs"], output=True)

    def cache_length(self, past_key: str) -> tuple[str, str]:
        """C = ctx_len from a KV buffer [B,nKV,C,D]: as a scalar [] and as [1]."""
        g = self.g
        ctx_len = g.op("Gather", g.op("Shape", past_key), g.const(2))  # [] = C
        return ctx_len, g.op("Unsqueeze", ctx_len, g.const([0]))  # [1] = C

    def cache_access(self, pos: str, batch_index: str | None, ctx_len: str,
                     sliding: bool) -> tuple[dict[bool, str], "_KvAccess"]:
        """The masks derived from positions ({sliding: [B,1,S,C]}; sliding: whether any layer
        needs its window's) and the KV buffers' write and read at those positions."""
        g = self.g
        keys = g.op("Range", g.const(0), ctx_len, g.const(1))  # [C]
        # Mask [B,1,S,C]: key k hidden from query q when k > position of q.
        query_pos = g.op("Unsqueeze", pos, g.const([-1]))  # [B,S,1]
        mask = g.op("Unsqueeze", g.op("Greater", keys, query_pos), g.const([1]))
        masks = {False: mask}
        if sliding:
            masks[True] = self.sliding_mask(mask, keys, query_pos)
        # Slots past a row's last position are invalid: they gather at INT32_MAX, their values
        # are zeroed and their keys masked (dialect.py says why INT32_MAX).
        limit = g.op("Unsqueeze", g.op("ReduceMax", pos, axes=[1], keepdims=1), g.const([1]))
        invalid = g.op("Greater", g.op("Unsqueeze", keys, g.const([0, 1])), limit)  # [B,1,C]
        ctx_indices = g.op("Where", invalid, invalid_index(g, INVALID_GATHER_INDEX),
                           g.op("Unsqueeze", keys, g.const([0, 1])))
        invalid_v = g.op("Unsqueeze", invalid, g.const([-1]))  # [B,1,C,1]
        # Continuous batching hands the scatter INT32_MAX for a padded token (position -1),
        # as QEfficient does; the plain scatter takes -1 (slot C-1) as QEfficient's does.
        write_pos = pos if batch_index is None else g.op(
            "Where", g.op("Less", pos, g.const(0)), invalid_index(g, INVALID_SCATTER_INDEX), pos)
        return masks, _KvAccess(g, write_pos, batch_index, ctx_indices, ctx_len, invalid_v)

    def scaled(self, x: str, factor: float) -> str:
        """x * factor (a float32 constant), x itself for 1."""
        return x if factor == 1.0 else self.g.op("Mul", x, self.g.const(factor, np.float32))

    def rope_at(self, pos: str, name: str, local: bool = False) -> tuple[str, str]:
        """cos, sin [B,1,S,D] at the positions, from tables of the model's max positions (as
        QEfficient: one graph serves every ctx_len); position -1 reads the last row, harmless
        for a pad."""
        g = self.g
        cos_t, sin_t = rope_tables(self.a, self.a.max_position_embeddings, local)
        return tuple(g.op("Unsqueeze", g.op("Gather", g.weight(f"{name}.{kind}_cached", t), pos),
                          g.const([1])) for kind, t in (("cos", cos_t), ("sin", sin_t)))

    def sliding_mask(self, causal: str, keys: str, query_pos: str) -> str:
        """The causal mask [B,1,S,C] of a sliding layer: key k also hidden when k <= q - window
        (transformers' sliding_window_overlay keeps k > q - window), from positions only."""
        g = self.g
        behind = g.op("LessOrEqual", g.op("Add", keys, g.const(self.a.sliding_window)),
                      query_pos)  # [B,S,C]
        return g.op("Or", causal, g.op("Unsqueeze", behind, g.const([1])))

    def layer(self, i: int, x: str, cos: str, sin: str, mask: str, kv: "_KvAccess",
              past: tuple[str, str], ctx: str) -> str:
        g, a = self.g, self.a
        p = f"model.layers.{i}"
        h, d, nh, nkv = a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads
        n = self.norm(x, f"{p}.input_layernorm.weight", h)
        q_norm, k_norm = (f"{p}.self_attn.{w}_norm.weight" if a.qk_norm else None for w in "qk")
        q, k, v = self.projections(n, f"{p}.self_attn", {"q_proj": nh * d, "k_proj": nkv * d,
                                                         "v_proj": nkv * d},
                                   "qkv_proj" if a.fused_projections else None, a.qkv_bias,
                                   then=[lambda y: self.heads(y, nh, q_norm),
                                         lambda y: self.heads(y, nkv, k_norm),
                                         lambda y: self.heads(y, nkv)])
        # RoPE's result Cast to the model's dtype, as QEfficient writes it (a no-op here)
        q, k = (g.op("Cast", self.rope(x, cos, sin), to=FLOAT) for x in (q, k))  # [B,n,S,D]

        attn = self.attend(i, q, k, v, mask, kv, past, ctx, f"{p}.self_attn")
        attn = self.scaled(self.linear(attn, f"{p}.self_attn.o_proj", nh * d, h, a.o_bias),
                           a.residual_scale)
        if a.sandwich_norms:  # Gemma: the attention output normed, the MLP input by its own
            attn = self.norm(attn, f"{p}.post_attention_layernorm.weight", h)
            x = g.op("Add", x, attn)
            n = self.norm(x, f"{p}.pre_feedforward_layernorm.weight", h)
        else:
            x = g.op("Add", x, attn)
            n = self.norm(x, f"{p}.post_attention_layernorm.weight", h)
        out = self.scaled(self.experts(i, n) if i in a.moe_layers else self.mlp(p, n),
                          a.residual_scale)
        if a.sandwich_norms:
            out = self.norm(out, f"{p}.post_feedforward_layernorm.weight", h)
        return g.op("Add", x, out)

    def attend(self, i: int, q: str, k: str, v: str, mask: str, kv: "_KvAccess",
               past: tuple[str, str], ctx: str, prefix: str) -> str:
        """Layer i's attention of q [B,nH,S,D] over its KV buffers once the call's k, v
        [B,nKV,S,D] are written at their positions (the retained-state outputs): [B,S,nH*D]."""
        g, a = self.g, self.a
        k_all = kv.write(past[0], k, f"past_key.{i}_RetainedState")
        v_all = kv.write(past[1], v, f"past_value.{i}_RetainedState")
        k_all, v_all = kv.read(k_all), kv.read(v_all, zero_invalid=True)  # [B,nKV,C,D]

        k_rep, v_rep = self.repeat_kv(k_all, ctx), self.repeat_kv(v_all, ctx)  # [B,nH,C,D]
        scores = g.op("MatMul", q, g.op("Transpose", k_rep, perm=[0, 1, 3, 2]))  # [B,nH,S,C]
        scores = g.op("Mul", scores, g.const(a.scores_scale, np.float32))
        scores = soft_cap(g, scores, a.attn_logit_softcapping)
        scores = g.op("Where", mask, g.const(MASKED, np.float32), scores)
        probs = self.softmax_with_sinks(scores, f"{prefix}.sinks", ctx) if \
            a.attention_sinks else g.op("Softmax", scores, axis=-1)
        attn = g.op("MatMul", probs, v_rep)  # [B,nH,S,D]
        return g.op("Reshape", g.op("Transpose", attn, perm=[0, 2, 1, 3]),
                    g.const([0, 0, a.num_heads * a.head_dim]))

    def softmax_with_sinks(self, scores: str, name: str, ctx: str) -> str:
        """GPT-OSS's attention sinks: each head's learned logit joins the softmax over the keys
        as one more column, which is then dropped (the weights sum to less than one)."""
        g, nh = self.g, self.a.num_heads
        sinks = g.op("Reshape", self.load(name, (nh,), False), g.const([1, nh, 1, 1]))
        shape = g.op("Concat", dim(g, scores, 0), g.const([nh]), dim(g, scores, 2),
                     g.const([1]), axis=0)
        joined = g.op("Concat", scores, g.op("Expand", sinks, shape), axis=-1)  # [B,nH,S,C+1]
        return g.op("Slice", g.op("Softmax", joined, axis=-1), g.const([0]), ctx, g.const([-1]))

    def mlp(self, p: str, n: str) -> str:
        """The gated MLP: down(act(gate(n)) * up(n))."""
        a = self.a
        gate, up = self.projections(n, f"{p}.mlp", {"gate_proj": a.intermediate_size,
                                                    "up_proj": a.intermediate_size},
                                    "gate_up_proj" if a.fused_projections else None, a.mlp_bias)
        act = self.g.op("Mul", self.activation(gate), up)
        return self.linear(act, f"{p}.mlp.down_proj", a.intermediate_size, a.hidden_size,
                           a.mlp_bias)

    def head(self, x: str, pos: str, nlk_input: str | None) -> None:
        a = self.a
        # A tied model still gets an [H, V] MatMul weight of its own, as QEfficient stores it:
        # the compiler compresses constant MatMul weights, not a Transpose of the embedding.
        source = "model.embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight"
        lm = self.load(source, (a.vocab_size, a.hidden_size), True, rows=self.vocab_subset)
        subset = None
        if self.vocab_subset is not None:
            column = np.zeros(a.vocab_size, np.int64)
            column[self.vocab_subset] = np.arange(len(self.vocab_subset))
            kept = np.zeros(a.vocab_size, np.bool_)
            kept[self.vocab_subset] = True
            subset = (self.g.weight(SUBSET_COLUMN, column.reshape(1, -1)),
                      self.g.weight(SUBSET_KEPT, kept))
        logits_head(self.g, x, pos, nlk_input, lm, a, subset_columns=subset,
                    turbo=write_turbo_weights(self.g, self.turbo) if self.turbo else None)


def dim(g: GraphBuilder, x: str, axis: int) -> str:
    """[1] = size of `x` along `axis`, as Gather(Shape(x), [axis]): QEfficient's graphs use
    Shape without start/end."""
    return g.op("Gather", g.op("Shape", x), g.const([axis]))


def soft_cap(g: GraphBuilder, x: str, cap: float | None, out: str | None = None) -> str:
    """cap * tanh(x / cap) (Gemma 2's scores, Gemma's logits where configured); x itself
    without a cap."""
    if not cap:
        return x if out is None else g.op("Identity", x, out=out)
    c = g.const(cap, np.float32)
    return g.op("Mul", g.op("Tanh", g.op("Div", x, c)), c, out=out)


def invalid_index(g: GraphBuilder, name: str) -> str:
    if all(t.name != name for t in g.initializers):
        g.initializers.append(numpy_helper.from_array(np.array(INT32_MAX, np.int64), name))
    return name


class _KvAccess:
    """The KV cache write and read of every layer: CtxScatter/CtxGather, or their CB variants
    (rows routed through batch_index into the full_batch_size pool)."""

    def __init__(self, g: GraphBuilder, pos: str, batch_index: str | None, ctx_indices: str,
                 ctx_len: str, invalid_v: str):
        self.g, self.pos, self.batch_index = g, pos, batch_index
        self.ctx_indices, self.ctx_len, self.invalid_v = ctx_indices, ctx_len, invalid_v

    def write(self, past: str, new: str, out: str) -> str:
        if self.batch_index is None:
            return self.g.call(dialect.ctx_scatter(), past, self.pos, new, out=out)
        return self.g.call(dialect.ctx_scatter_cb(), past, self.batch_index, self.pos, new,
                           out=out)

    def read(self, cache: str, zero_invalid: bool = False) -> str:
        g = self.g
        if self.batch_index is None:
            out = g.call(dialect.ctx_gather(), cache, self.ctx_indices, self.ctx_len)
        else:
            out = g.call(dialect.ctx_gather_cb(), cache, self.batch_index, self.ctx_indices,
                         self.ctx_len)
        if zero_invalid:
            out = g.op("Where", self.invalid_v, g.const(0.0, np.float32), out)
        return out


def logits_head(g: GraphBuilder, x: str, pos: str, nlk_input: str | None, lm: str | None,
                a: ArchSpec, matmul=None, vocab_subset: str | None = None,
                subset_columns: tuple[str, str] | None = None, turbo: TurboGraph | None = None) -> None:
    """Logits for the last real token (draft) or the N tokens ending there (target), picked as
    QEfficient picks them: first row max(last + 1 - N, 0) written as a Where, rows Tiled over
    the hidden size for GatherElements. N never exceeds seq_len (every specialization has
    seq_len >= num_logits_to_keep), so no row needs a clamp.
    `matmul(x, out)` replaces the plain MatMul by `lm` (a lowering's quantized kernel).
    A draft's vocabulary subset: `lm` holds the kept rows only, and their logits are spread
    back over the whole vocabulary, MASKED for every other token, either by a GatherElements
    of each token's column and a Where on the kept mask (`subset_columns`, the card graph's
    form) or by a ScatterND of the kept token ids `vocab_subset` ([Vs, 1]) into a MASKED buffer
    (ONNX Runtime's fused lowering, where it is 5x faster than a Gather over the vocabulary)."""
    last = g.op("ArgMax", pos, axis=1, keepdims=1)  # [B,1] index of the largest position
    if nlk_input is None:
        rows = last
    else:
        n = g.op("Gather", g.op("Shape", nlk_input), g.const(0))  # [] = N
        first = g.op("Where", g.op("Less", last, n), g.const(0),
                     g.op("Sub", g.op("Add", last, g.const(1)), n))  # [B,1]
        span = g.op("Range", g.const(0), n, g.const(1))  # [N]
        rows = g.op("Add", first, g.op("Unsqueeze", span, g.const([0])))  # [B,N]
    picked = g.op("GatherElements", x, g.op("Tile", g.op("Unsqueeze", rows, g.const([-1])),
                                             g.const([1, 1, a.hidden_size])), axis=1)  # [B,N,H]
    picked = turbo_stack(g, picked, turbo) if turbo else picked  # turbo.py: [B,N,heads+1,H]
    subset = vocab_subset is not None or subset_columns is not None
    out = g._name("subset_logits") if subset else "logits"
    # Granite's divisor, then Gemma's soft-capping, on the head's own output, before a subset is
    # spread (MASKED stays)
    post = a.final_logit_softcapping or a.logits_divisor != 1.0
    raw = g._name("raw_logits") if post else out
    if matmul is None:
        g.op("MatMul", picked, lm, out=raw)
    else:
        matmul(picked, raw)
    if a.logits_divisor != 1.0:
        raw = g.op("Div", raw, g.const(a.logits_divisor, np.float32),
                   **({"out": out} if not a.final_logit_softcapping else {}))
    if a.final_logit_softcapping:
        soft_cap(g, raw, a.final_logit_softcapping, out=out)
    if subset_columns is not None:  # the ops and attributes of QEfficient's TLM row pick
        column, kept = subset_columns
        rows = g.op("Reshape", out, g.const([0, -1]))  # [B,Vs]
        index = g.op("Expand", column, g.op("Concat", dim(g, rows, 0),
                                            g.const([a.vocab_size]), axis=0))  # [B,V]
        full = g.op("Where", kept, g.op("GatherElements", rows, index, axis=1),
                    g.const(MASKED, np.float32))  # [B,V]
        g.op("Unsqueeze", full, g.const([1]), out="logits")  # [B,1,V]
    elif vocab_subset is not None:
        # rows are tokens, so [B,1,Vs] goes through [Vs,B] and back
        cols = g.op("Transpose", g.op("Reshape", out, g.const([0, -1])), perm=[1, 0])
        shape = g.op("Concat", g.const([a.vocab_size]), dim(g, cols, 1), axis=0)
        full = g.op("ScatterND", g.op("ConstantOfShape", shape, value=helper.make_tensor(
            "value", FLOAT, [1], [MASKED])), vocab_subset, cols)  # [V, B]
        g.op("Unsqueeze", g.op("Transpose", full, perm=[1, 0]), g.const([1]), out="logits")

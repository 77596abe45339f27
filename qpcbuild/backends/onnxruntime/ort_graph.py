"""The ONNX Runtime lowering of the portable decoder graph: same inputs, outputs and semantics,
built from ORT's fused CPU kernels so a decode step does not pay for the whole static context.

- q/k/v and gate/up projections are single MatMuls on concatenated weights;
- RMSNorm and residual adds are (Skip)SimplifiedLayerNormalization (Gemma's (1 + w) norms read
  the exported weights, which hold 1 + w already; its sandwich norms are one more norm on each
  branch's output before the residual add);
- Gemma's gelu_pytorch_tanh is com.microsoft.FastGelu (the same tanh form, one kernel);
- attention is com.microsoft.GroupQueryAttention over the same [B, nKV, ctx_len, D] buffers,
  updated in place (the runtime binds each KV input and its _RetainedState output to one buffer)
  and reading only the valid prefix of each row; a sliding layer whose window is shorter than
  ctx_len sets the kernel's local_window_size, Gemma 2's score soft-cap its softcap, and Gemma 3's
  sliding layers read cos/sin caches of their own RoPE base;
- with `weights="int8"` or `"int4"` each matmul weight is stored as 8- or 4-bit blocks of 32
  along K for com.microsoft.MatMulNBits: a quarter or an eighth of the bytes a memory-bound call
  has to read (lossless for a draft; a target's output changes, so the recipe must ask for it;
  both multiply with int8 activations; a target's calls carry at least 2 tokens, see
  TARGET_NBITS);
- with `numerics` asking for the card's formats (see `qpcbuild.numerics`): every matmul weight
  is rounded to MXFP6 (stored as float32 values on its grid; the embedding Gather stays exact,
  as the card compresses matmul weights only), and the new K and V of each call are
  quantized-dequantized to MXINT8 along head_dim before GroupQueryAttention stores them. K is
  quantized after RoPE (what the card's KV buffer holds), so such a graph applies RoPE itself
  and runs GroupQueryAttention with do_rotary=0.

GroupQueryAttention places a row's S new tokens at slots start..start+S-1 with start =
position_ids[b, 0], so padded tail slots (-1) are written after the real tokens instead of at
ctx_len-1; they lie beyond the row's length and stay invisible until overwritten, exactly like
stale draft slots. The runtime keeps every window inside the buffer (see engine._verify).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from ...models.arch import ArchSpec
from ...export import MS
from ...export.builder import GraphBuilder, weight_key
from ...export.decoder import SUBSET_KEPT, VOCAB_SUBSET, logits_head
from ...export.eagle3 import FC_WEIGHT, feature_output
from ...export.turbo import TurboGraph, graph_names
from ...models.graph_io import declare, graph_io
from ...models.turbo_heads import MAX_HEADS
from ...numerics import BLOCK as MX_BLOCK
from ...numerics import KV_FORMAT, WEIGHT_FORMAT, mxfp6_int8_blocks, mxfp6_weight
from .fused_ops import attention_lengths, grouped_query_attention, norm, skip_norm
from .nbits import LEGACY_NBITS, WEIGHT_BITS, NbitsLayout, matmul_nbits
from .weights import PortableWeights
from .window import local_window_size, reading, windowed


def rope_tables(arch: ArchSpec, ctx_len: int,
                local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's cos/sin caches [ctx_len, D/2]; `local`: the sliding layers' own
    RoPE base (Gemma 3)."""
    freqs = np.outer(np.arange(ctx_len, dtype=np.float32), arch.inv_freq(local))  # as HF
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def build_ort_graph(arch: ArchSpec, w: PortableWeights, role: str, batch: int | str, ctx_len: int,
                    out_dir: Path, metadata: dict[str, str], weights: str = "float32",
                    numerics: dict[str, str] | None = None,
                    layout: NbitsLayout = LEGACY_NBITS) -> Path:
    """batch: the graph's batch dim, a size or a name (symbolic: single-token calls may carry
    several rows). layout: how int8/int4 weights are stored and multiplied. numerics:
    {"weights": "mxfp6-e2m3-block32" | "float32", "kv": "mxint8-block32" | "float32"} (None:
    exact float32)."""
    numerics = numerics or {}
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "model.onnx.data", "wb") as data:
        g = GraphBuilder(data, "model.onnx.data")
        _Lowered(g, arch, w, batch, ctx_len, weights, layout,
                 mxfp6=numerics.get("weights") == WEIGHT_FORMAT,
                 mxint8=numerics.get("kv") == KV_FORMAT,
                 turbo_layers=int(metadata.get("turbo_num_layers", "0")),
                 eagle3_layers=tuple(int(i) for i in metadata.get("eagle3_layers", "").split(",")
                                     if i)).build(role)
        if windowed(arch, ctx_len):  # the kernel's reading, checked again where it is loaded
            metadata = {**metadata, **reading()}
        model = g.model(f"qpcbuild_{role}_ort", 17, metadata)
    model.opset_import.append(helper.make_opsetid(MS, 1))
    path = out_dir / "model.onnx"
    path.write_bytes(model.SerializeToString(deterministic=True))
    return path


class _Lowered:
    def __init__(self, g: GraphBuilder, a: ArchSpec, w: PortableWeights, batch: int | str, ctx: int,
                 weights: str = "float32", layout: NbitsLayout = LEGACY_NBITS,
                 mxfp6: bool = False, mxint8: bool = False, turbo_layers: int = 0,
                 eagle3_layers: tuple[int, ...] = ()):
        self.g, self.a, self.w, self.batch, self.ctx = g, a, w, batch, ctx
        self.eagle3_layers = eagle3_layers  # an EAGLE-3 head's feature output (export/eagle3.py)
        # the portable graph's turbo heads (export/turbo.py), read back by their names
        self.turbo_heads = next(h for h in range(MAX_HEADS + 1)
                                if not w.has(graph_names(h)[0])) if turbo_layers else 0
        self.turbo_layers = turbo_layers
        self.bits = WEIGHT_BITS.get(weights)  # None: float32 MatMuls
        self.layout = layout
        self.mxfp6, self.mxint8 = mxfp6, mxint8
        self.rot_pos: str | None = None  # [B, S] positions of the new tokens (mxint8 only)

    def weight(self, name: str, arr: np.ndarray | None = None) -> str:
        return self.g.weight(name, self.w.get(name) if arr is None else arr)

    def project(self, x: str, name: str, arr: np.ndarray | None = None,
                out: str | None = None, head: bool = False) -> str:
        """x @ W for a [K, N] weight, in the lowering's weight format."""
        arr = self.w.get(name) if arr is None else arr
        if self.bits is None or (head and not self.layout.quantize_head):
            if self.mxfp6:  # the card's weights: float32 values on the MXFP6 grid
                arr = mxfp6_weight(arr)
            return self.g.op("MatMul", x, self.g.weight(name, arr), out=out)
        # int8 with mxfp6: the MXFP6 values exactly, in the same 8-bit layout of blocks of 32
        # (the recipe refuses int4 with mxfp6)
        blocks = mxfp6_int8_blocks(arr) if self.mxfp6 else None
        return matmul_nbits(self.g, x, name, arr, self.bits, self.layout, out, blocks)

    def scaled(self, x: str, factor: float) -> str:
        """x * factor, x itself for 1 (every family but Granite)."""
        return x if factor == 1.0 else self.g.op("Mul", x, self.g.const(factor, np.float32))

    def norm_weight(self, name: str) -> str:
        """A norm's scale as exported: Gemma's checkpoints store w - 1, the export 1 + w under a
        name of its own (export/builder.py, weight_key); every other family's w as it is."""
        key = weight_key(name, False, False, self.a.norm_offset)
        return self.g.weight(key, self.w.get(key))

    def norm(self, x: str, weight: str) -> str:
        return norm(self.g, x, self.norm_weight(weight), self.a.rms_norm_eps)

    def skip_norm(self, x: str, delta: str, weight: str) -> tuple[str, str]:
        """(norm(x + delta), x + delta) in one kernel."""
        return skip_norm(self.g, x, delta, self.norm_weight(weight), self.a.rms_norm_eps)

    def build(self, role: str) -> None:
        g, a, b, c = self.g, self.a, self.batch, self.ctx
        # the portable graph's I/O with ctx_len (and a batch size) fixed (no batch_index: the
        # runtime binds each row's KV itself)
        io = graph_io(role, a, False, self.turbo_heads, eagle3_features=bool(self.eagle3_layers))
        fixed = {"batch_size": b, "ctx_len": c}
        given = declare(g, io["inputs"], output=False, fixed=fixed)
        ids, pos = given["input_ids"], given["position_ids"]
        past = [(given[f"past_key.{i}"], given[f"past_value.{i}"]) for i in range(a.num_layers)]
        nlk = given.get("num_logits_to_keep")

        # (rows with no real token (all -1) write their slots at the end of the buffer)
        seq, start, seqlens, total = attention_lengths(g, ids, pos, c)
        cos, sin = rope_tables(a, c)
        rope = {False: (g.weight("rope_cos", cos), g.weight("rope_sin", sin))}
        if a.has_local_rope:  # Gemma 3's sliding layers: a RoPE base of their own
            cos, sin = rope_tables(a, c, local=True)
            rope[True] = (g.weight("rope_cos.local", cos), g.weight("rope_sin.local", sin))
        if self.mxint8:  # the slots GroupQueryAttention writes: start .. start + S - 1
            steps = g.op("Range", g.const(0), g.op("Squeeze", seq, g.const([0])), g.const(1))
            self.rot_pos = g.op("Add", g.op("Unsqueeze", start, g.const([1])), steps)

        x = self.scaled(g.op("Gather", self.weight("model.embed_tokens.weight"), ids),
                        a.embedding_scale)  # Granite's embedding multiplier
        self.w.release(["model.embed_tokens.weight"])  # the LM head's is its own tensor
        h = self.norm(x, "model.layers.0.input_layernorm.weight")
        aux: dict[int, str] = {}  # the residual stream entering each layer (EAGLE-3's inputs)
        for i in range(a.num_layers):
            aux[i] = x
            p = f"model.layers.{i}"
            cos, sin = rope[a.is_sliding(i) and a.has_local_rope]
            # Granite scales each residual branch
            delta = self.scaled(self.attention(i, h, past[i], seqlens, total, cos, sin),
                                a.residual_scale)
            if a.sandwich_norms:  # Gemma: the attention output normed, the MLP input by its own
                delta = self.norm(delta, f"{p}.post_attention_layernorm.weight")
                h, x = self.skip_norm(x, delta, f"{p}.pre_feedforward_layernorm.weight")
            else:
                h, x = self.skip_norm(x, delta, f"{p}.post_attention_layernorm.weight")
            delta = self.scaled(self.mlp(i, h), a.residual_scale)
            if a.sandwich_norms:
                delta = self.norm(delta, f"{p}.post_feedforward_layernorm.weight")
            nxt = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < a.num_layers \
                else "model.norm.weight"
            h, x = self.skip_norm(x, delta, nxt)
            # no later step reads a layer's own tensors
            self.w.release([n for n in self.w.entries if n.startswith(f"{p}.")])
        self.head(h, pos, nlk)
        if self.eagle3_layers:
            feature_output(g, [aux[i] for i in self.eagle3_layers], self.weight(FC_WEIGHT))
        declare(g, io["outputs"], output=True, fixed=fixed)

    def attention(self, i: int, h: str, past: tuple[str, str], seqlens: str, total: str,
                  cos: str, sin: str) -> str:
        g, a = self.g, self.a
        p = f"model.layers.{i}.self_attn"
        parts = [self.w.get(f"{p}.{n}_proj.weight^T") for n in ("q", "k", "v")]
        qkv = self.project(h, f"{p}.qkv^T", np.concatenate(parts, axis=1))
        if a.qkv_bias:
            bias = np.concatenate([self.w.get(f"{p}.{n}_proj.bias") for n in ("q", "k", "v")])
            qkv = g.op("Add", qkv, self.weight(f"{p}.qkv_bias", bias))
        sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                 a.num_kv_heads * a.head_dim]
        q, k, v = g.op("Split", qkv, g.const(sizes), axis=-1, n_out=3)
        if a.qk_norm:  # per-head RMSNorm before RoPE (Qwen3)
            q = self.head_norm(q, a.num_heads, f"{p}.q_norm.weight")
            k = self.head_norm(k, a.num_kv_heads, f"{p}.k_norm.weight")
        inputs = [q, k, v, past[0], past[1], seqlens, total, cos, sin]
        if self.mxint8:
            # The cache holds post-RoPE K: rotate here, quantize what GQA will store.
            q = self.rope(q, a.num_heads, cos, sin)
            k = self.mxint8_qdq(self.rope(k, a.num_kv_heads, cos, sin), a.num_kv_heads)
            v = self.mxint8_qdq(v, a.num_kv_heads)
            inputs = [q, k, v, past[0], past[1], seqlens, total]
        # A sliding layer keeps transformers' keys q - window < k <= q (window.py asks the
        # kernel which attribute does that); only where the window hides keys at this ctx_len:
        # a wider one changes nothing, and those graphs keep their bytes.
        extra = {"local_window_size": local_window_size(a.sliding_window)} \
            if a.is_sliding(i) and a.sliding_window < self.ctx else {}
        if a.attn_logit_softcapping:  # Gemma 2: cap * tanh(scores / cap), scale applied first
            extra["softcap"] = a.attn_logit_softcapping
        out = grouped_query_attention(
            g, inputs, [f"past_key.{i}_RetainedState", f"past_value.{i}_RetainedState"],
            num_heads=a.num_heads, kv_num_heads=a.num_kv_heads,
            do_rotary=0 if self.mxint8 else 1, rotary_interleaved=0,
            scale=a.scores_scale,  # 1/sqrt(head_dim), Gemma's query_pre_attn_scalar ** -0.5,
            **extra)  # or Granite's attention multiplier
        o = self.project(out, f"{p}.o_proj.weight^T")
        return g.op("Add", o, self.weight(f"{p}.o_proj.bias")) if a.o_bias else o

    def rope(self, x: str, heads: int, cos: str, sin: str) -> str:
        """Rotary embedding of [B, S, heads * D] at self.rot_pos, half-split (rotate_half) as
        GroupQueryAttention's rotary_interleaved=0, from the same cos/sin tables."""
        g, d = self.g, self.a.head_dim
        c = g.op("Unsqueeze", g.op("Gather", cos, self.rot_pos), g.const([2]))  # [B,S,1,D/2]
        s = g.op("Unsqueeze", g.op("Gather", sin, self.rot_pos), g.const([2]))
        x1, x2 = g.op("Split", g.op("Reshape", x, g.const([0, 0, heads, d])),
                      g.const([d // 2, d // 2]), axis=-1, n_out=2)
        r1 = g.op("Sub", g.op("Mul", x1, c), g.op("Mul", x2, s))
        r2 = g.op("Add", g.op("Mul", x2, c), g.op("Mul", x1, s))
        return g.op("Reshape", g.op("Concat", r1, r2, axis=-1), g.const([0, 0, heads * d]))

    def mxint8_qdq(self, x: str, heads: int) -> str:
        """[B, S, heads * D] quantized-dequantized to MXINT8, blocks of 32 along each head's D
        (the rules of qpcbuild.numerics, in standard ONNX ops)."""
        g, d = self.g, self.a.head_dim
        f = lambda v: g.const(v, np.float32)  # noqa: E731
        nb = -(-d // MX_BLOCK)
        xb = g.op("Reshape", x, g.const([0, 0, heads, d]))
        if nb * MX_BLOCK != d:  # a short last block: zeros never change a block's max
            xb = g.op("Pad", xb, g.const([0, 0, 0, 0, 0, 0, 0, nb * MX_BLOCK - d]))
        xb = g.op("Reshape", xb, g.const([0, 0, heads, nb, MX_BLOCK]))
        amax = g.op("ReduceMax", g.op("Abs", xb), axes=[-1], keepdims=1)
        # floor(log2(amax)) from Log, then made exact with two power-of-two comparisons
        e = g.op("Floor", g.op("Div", g.op("Log", amax), f(np.log(2.0))))
        p = g.op("Pow", f(2.0), e)
        e = g.op("Add", e, g.op("Cast", g.op("LessOrEqual", g.op("Mul", p, f(2.0)), amax),
                                to=TensorProto.FLOAT))
        e = g.op("Sub", e, g.op("Cast", g.op("Greater", p, amax), to=TensorProto.FLOAT))
        scale = g.op("Pow", f(2.0), g.op("Clip", e, f(-127.0), f(127.0)))  # emax_elem 0
        k = g.op("Clip", g.op("Round", g.op("Mul", g.op("Div", xb, scale), f(64.0))),
                 f(-127.0), f(127.0))  # Round: half to even
        y = g.op("Mul", g.op("Div", k, f(64.0)), scale)
        # A block holding NaN or an infinity becomes NaN throughout (x * 0 is NaN for those).
        bad = g.op("ReduceSum", g.op("Mul", xb, f(0.0)), g.const([-1]), keepdims=1)
        y = g.op("Reshape", g.op("Add", y, bad), g.const([0, 0, heads, nb * MX_BLOCK]))
        if nb * MX_BLOCK != d:
            y = g.op("Slice", y, g.const([0]), g.const([d]), g.const([3]))
        return g.op("Reshape", y, g.const([0, 0, heads * d]))

    def head_norm(self, x: str, heads: int, weight: str) -> str:
        g, d = self.g, self.a.head_dim
        y = self.norm(g.op("Reshape", x, g.const([0, 0, heads, d])), weight)
        return g.op("Reshape", y, g.const([0, 0, heads * d]))

    def routed(self, i: int, h: str) -> str:
        """A routed layer (Qwen3-MoE, Mixtral) as one com.microsoft.MoE node, which runs only the
        top-k experts of each token: the router's logits in, the kernel's softmax and top k
        (renormalized as the model says), SwiGLU with alpha 1 and beta 0 (SiLU gating). Its
        weights are stacked here: gate and up interleaved row by row [E, 2W, H], down [E, H, W]
        (the plan keeps int8/int4 and MXFP6 weights away from these layers)."""
        g, a = self.g, self.a
        block, gate, up, down = a.moe_names
        p = f"model.layers.{i}.{block}"
        experts = [f"{p}.experts.{j}" for j in range(a.num_experts)]
        fc1 = np.stack([np.stack([self.w.get(f"{x}.{gate}.weight^T").T,
                                  self.w.get(f"{x}.{up}.weight^T").T], axis=1)
                        .reshape(2 * a.expert_intermediate_size, a.hidden_size)
                        for x in experts])
        fc2 = np.stack([self.w.get(f"{x}.{down}.weight^T").T for x in experts])
        router = g.op("Reshape", self.project(h, f"{p}.gate.weight^T"),
                      g.const([-1, a.num_experts]))
        out = g._name("moe")
        g.nodes.append(helper.make_node(
            "MoE", [h, router, self.weight(f"{p}.experts.fc1", fc1), "",
                    self.weight(f"{p}.experts.fc2", fc2)], [out], domain=MS,
            name=f"n{len(g.nodes)}_MoE", k=a.experts_per_token, activation_type="swiglu",
            swiglu_fusion=1, normalize_routing_weights=int(a.norm_topk_prob),
            activation_alpha=1.0, activation_beta=0.0))
        return out

    def mlp(self, i: int, h: str) -> str:
        g, a = self.g, self.a
        if i in a.moe_layers:
            return self.routed(i, h)
        p = f"model.layers.{i}.mlp"
        gate_up = np.concatenate([self.w.get(f"{p}.gate_proj.weight^T"),
                                  self.w.get(f"{p}.up_proj.weight^T")], axis=1)
        y = self.project(h, f"{p}.gate_up^T", gate_up)
        if a.mlp_bias:
            bias = np.concatenate([self.w.get(f"{p}.gate_proj.bias"), self.w.get(f"{p}.up_proj.bias")])
            y = g.op("Add", y, self.weight(f"{p}.gate_up_bias", bias))
        gate, up = g.op("Split", y, g.const([a.intermediate_size] * 2), axis=-1, n_out=2)
        act = g.op("Mul", self.activation(gate), up)
        down = self.project(act, f"{p}.down_proj.weight^T")
        return g.op("Add", down, self.weight(f"{p}.down_proj.bias")) if a.mlp_bias else down

    def activation(self, gate: str) -> str:
        """The gated MLP's activation: SiLU, or Gemma's gelu_pytorch_tanh as ORT's FastGelu
        (0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), the portable graph's ops in one)."""
        g = self.g
        if self.a.hidden_act == "silu":
            return g.op("Mul", gate, g.op("Sigmoid", gate))
        return g.op("FastGelu", gate, domain=MS)

    def head(self, x: str, pos: str, nlk: str | None) -> None:
        # The portable graph stores the head [H, V] (a tied model's too), so no step transposes;
        # a draft's vocabulary subset keeps its rows [H, Vs] and their token ids.
        name = next(n + suffix for suffix in ("[subset]", "") for n in
                    ("lm_head.weight^T", "model.embed_tokens.weight^T") if self.w.has(n + suffix))
        lm = self.w.get(name)
        ids = None if not name.endswith("[subset]") else self.g.weight(
            VOCAB_SUBSET, np.flatnonzero(self.w.get(SUBSET_KEPT)).astype(np.int64).reshape(-1, 1))
        turbo = TurboGraph(tuple((self.weight(wn), self.weight(bn)) for wn, bn in
                                 map(graph_names, range(self.turbo_heads))),
                           self.turbo_layers) if self.turbo_heads else None
        logits_head(self.g, x, pos, nlk, None, self.a, turbo=turbo,
                    matmul=lambda h, out: self.project(h, "lm_head^T", lm, out=out, head=True),
                    vocab_subset=ids)

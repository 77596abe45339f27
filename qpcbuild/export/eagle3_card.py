"""The card form of an EAGLE-3 head's graph: what qaic-compile gets for the head, beside the
target's card graph (the ONNX Runtime form, with a host-managed cache, is eagle3.py's).

The Cloud AI compiler runs a graph whose KV cache is retained state, so the head speaks the
target's dialect (decoder.py, dialect.py): its one layer's cache is `past_key.0` /
`past_value.0` [B, nKV, ctx_len, D], written with CtxScatter at `position_ids` and read back
whole with CtxGather, and returned as `past_key.0_RetainedState` / `past_value.0_RetainedState`;
the mask comes from positions alone (key k hidden from query q when k > position q; -1 marks a
padded slot), so the entries a rejected draft left past a row's position are invisible until the
next catch-up overwrites them, as in the target. Built by the decoder's own pieces (norms, RoPE,
projections, attention over the cache, MLP), over an ArchSpec of the head's Llama layer.

Inputs `input_ids` [B, S], `hidden` [B, S, H] (the target's feature, or the head's previous
`hidden_out`), `position_ids` [B, S] (and `batch_index` with continuous batching); outputs
`logits` [B, S, Vd] over the draft vocabulary and `hidden_out` [B, S, H]. d2t is not an output:
it stays with the head's folder and the manifest, as the card runtime would map draft ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto

from . import DATA_FILE, GRAPH_FILE, OPSET
from ..models.arch import ArchSpec
from ..models.eagle3_head import LAYER, Eagle3Head, Eagle3HeadInfo
from ..models.graph_io import declare, eagle3_head_io
from .builder import GraphBuilder, save, weight_key
from .decoder import Decoder
from .eagle3 import head_info_metadata

EMBED = "embed_tokens.weight"  # the target's token embedding, copied into the head's file
HEAD_ARCHITECTURE = "Eagle3Speculator"  # as the speculators format's config.json names it


def head_arch(info: Eagle3HeadInfo, max_positions: int) -> ArchSpec:
    """The head's decoder layer as an ArchSpec (a one-layer Llama over the draft vocabulary),
    so the decoder's pieces build it; `max_positions`: the target's (the RoPE tables' rows)."""
    return ArchSpec(architecture="LlamaForCausalLM", family="llama",
                    hidden_size=info.hidden_size, num_layers=1, num_heads=info.num_heads,
                    num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                    intermediate_size=info.intermediate_size, vocab_size=info.draft_vocab_size,
                    rms_norm_eps=info.rms_norm_eps, rope_theta=info.rope_theta,
                    rope_scaling=None, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                    mlp_bias=False, qk_norm=False, max_position_embeddings=max_positions,
                    torch_dtype="float32")


def head_io(info: Eagle3HeadInfo, continuous_batching: bool) -> dict[str, list[dict]]:
    """The card head graph's inputs and outputs (graph_io's form)."""
    return eagle3_head_io(info.hidden_size, info.num_kv_heads, info.head_dim,
                          info.draft_vocab_size, continuous_batching)


class HeadCardGraph(Decoder):
    """Builds the card head graph into `g` from the head's weights and the target's embedding."""

    def __init__(self, g: GraphBuilder, head: Eagle3Head, embed: np.ndarray, max_positions: int):
        self.info = head.info
        self.weights = {**head.weights, EMBED: embed}
        self.loaded: dict[str, str] = {}
        super().__init__(g, head_arch(head.info, max_positions), self.load_weight)

    def load_weight(self, name: str, shape: tuple[int, ...], transpose: bool,
                    rows: np.ndarray | None = None, offset: float = 0.0) -> str:
        """The decoder's WeightLoader over the head's tensors (float32, read and checked by
        models/eagle3_head.py); no subset or offset applies to a head."""
        values = self.weights[name]
        assert values.shape == shape and rows is None and not offset, (name, values.shape, shape)
        key = weight_key(name, transpose, False, 0.0)
        if key not in self.loaded:
            self.loaded[key] = self.g.weight(key, values.T if transpose else values)
        return self.loaded[key]

    def build_head(self, continuous_batching: bool) -> None:
        g, a, i = self.g, self.a, self.info
        h, d, nh, nkv = a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads
        io = head_io(i, continuous_batching)
        given = declare(g, io["inputs"], output=False)
        ids, hidden, pos = given["input_ids"], given["hidden"], given["position_ids"]
        past = given["past_key.0"], given["past_value.0"]
        ctx_len, ctx = self.cache_length(past[0])
        cos, sin = self.rope_at(pos, "rope")  # [B,1,S,D]
        masks, kv = self.cache_access(pos, given.get("batch_index"), ctx_len, sliding=False)

        emb = g.op("Gather", self.load(EMBED, self.weights[EMBED].shape, False), ids)  # [B,S,H]
        normed_h = self.norm(hidden, f"{LAYER}.hidden_norm.weight", h)
        z = g.op("Concat", self.norm(emb, f"{LAYER}.input_layernorm.weight", h), normed_h,
                 axis=-1)  # [B,S,2H]: q/k/v read the token and the feature side by side
        residual = normed_h if i.norm_before_residual else hidden
        p = f"{LAYER}.self_attn"
        q, k, v = (self.heads(self.linear(z, f"{p}.{name}", 2 * h, n * d, False), n)
                   for name, n in (("q_proj", nh), ("k_proj", nkv), ("v_proj", nkv)))
        q, k = (g.op("Cast", self.rope(x, cos, sin), to=TensorProto.FLOAT) for x in (q, k))
        attn = self.attend(0, q, k, v, masks[False], kv, past, ctx, p)  # [B,S,nH*D]
        x = g.op("Add", residual, self.linear(attn, f"{p}.o_proj", nh * d, h, False))
        mlp = self.mlp(LAYER, self.norm(x, f"{LAYER}.post_attention_layernorm.weight", h))
        out = g.op("Add", x, mlp, out="hidden_out")  # before the final norm: the next hidden
        g.op("MatMul", self.norm(out, "norm.weight", h),
             self.load("lm_head.weight", (i.draft_vocab_size, h), True), out="logits")
        declare(g, io["outputs"], output=True)


def export_card_head(head: Eagle3Head, embed: np.ndarray, max_positions: int,
                     continuous_batching: bool, out_dir: Path) -> Path:
    """Write `out_dir/model.onnx` + `model.onnx.data` of the card head graph; the graph's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / DATA_FILE, "wb") as data:
        g = GraphBuilder(data, DATA_FILE)
        HeadCardGraph(g, head, embed, max_positions).build_head(continuous_batching)
    # (the architecture names the form for `qpcbuild doctor`: an EAGLE-3 head, its own)
    metadata = {**head_info_metadata(head.info), "graph": "card",
                "architecture": HEAD_ARCHITECTURE,
                "continuous_batching": str(continuous_batching).lower()}
    save(g.model("qpcbuild_eagle3_head", OPSET, metadata), out_dir / GRAPH_FILE)
    return out_dir / GRAPH_FILE


def target_embedding(target_graph: Path) -> np.ndarray:
    """The token embedding [V, H] of an exported target graph, float32 (a float16 export's
    too), read from its external data file."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(target_graph), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == f"model.{EMBED}")
    return numpy_helper.to_array(tensor, str(target_graph.parent)).astype(np.float32)

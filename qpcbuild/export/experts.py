"""Routed (mixture-of-experts) blocks of the decoder: Qwen3-MoE and Mixtral (one tensor per
expert projection), GPT-OSS (experts stacked in [E, ...] tensors), in two forms:

- the card's (`experts`, `stacked_experts`), exact and dense: every expert runs on every token
  and the router's weights, zero for experts a token did not choose, pick the sum;
- ONNX Runtime's (`moe_op`, when the decoder is built with `moe_op=True`): one
  com.microsoft.MoE node per routed layer, whose CPU kernel runs only the top-k experts of each
  token (the ORT backend rebuilds a MoE model's graph in this form, backends/onnxruntime/moe.py).

The methods are part of `decoder.Decoder` (its g, a, load, linear, activation and slice_last)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
from onnx import helper

from . import MS

if TYPE_CHECKING:
    from ..models.arch import ArchSpec
    from .builder import GraphBuilder


class RoutedExperts:
    g: GraphBuilder
    a: ArchSpec
    load: Callable[..., str]
    moe_op: bool = False  # ONNX Runtime's MoE operator instead of the dense form

    def experts(self, i: int, n: str) -> str:
        """A routed layer (Qwen3-MoE, Mixtral), exact and dense: the router's softmax, its top k
        (renormalized where the model does) spread back to a [B,S,E] weight per expert, zero
        for the experts a token did not choose, and every expert's MLP on every token, summed
        in expert order as transformers adds them. E times the MLP's work per token: the
        portable form, not a fast one."""
        g, a = self.g, self.a
        h, e_width, count = a.hidden_size, a.expert_intermediate_size, a.num_experts
        block, gate_name, up_name, down_name = a.moe_names
        p = f"model.layers.{i}.{block}"
        if self.moe_op and (a.stacked_experts or a.hidden_act == "silu"):
            return self.routed_by_moe_op(p, n)
        if a.stacked_experts:
            return self.stacked_experts(p, n)
        probs = g.op("Softmax", self.linear(n, f"{p}.gate", h, count, False), axis=-1)
        top, chosen = g.op("TopK", probs, g.const([a.experts_per_token]), axis=-1, n_out=2)
        if a.norm_topk_prob:
            top = g.op("Div", top, g.op("ReduceSum", top, g.const([-1]), keepdims=1))
        weights = g.op("ScatterElements", g.op("Mul", probs, g.const(0.0, np.float32)), chosen,
                       top, axis=-1)  # [B,S,E]
        out = None
        for j in range(count):
            x = f"{p}.experts.{j}"
            act = g.op("Mul", self.activation(self.linear(n, f"{x}.{gate_name}", h, e_width,
                                                          False)),
                       self.linear(n, f"{x}.{up_name}", h, e_width, False))
            y = g.op("Mul", self.linear(act, f"{x}.{down_name}", e_width, h, False),
                     self.slice_last(weights, j, j + 1))
            out = y if out is None else g.op("Add", out, y)
        return out

    def stacked_experts(self, p: str, n: str) -> str:
        """GPT-OSS's routed block, exact and dense like `experts`: a softmax over the top-k
        router logits (router with a bias), experts stacked in [E, ...] tensors with biases
        (each one Gathered from the stack), gate and up interleaved in gate_up_proj, and the
        clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate)."""
        g, a = self.g, self.a
        h, width, count = a.hidden_size, a.expert_intermediate_size, a.num_experts
        logits = self.linear(n, f"{p}.router", h, count, True)
        top, chosen = g.op("TopK", logits, g.const([a.experts_per_token]), axis=-1, n_out=2)
        weights = g.op("ScatterElements", g.op("Mul", logits, g.const(0.0, np.float32)), chosen,
                       g.op("Softmax", top, axis=-1), axis=-1)  # [B,S,E]
        x = f"{p}.experts"
        stacks = {name: self.load(f"{x}.{name}", shape, False) for name, shape in (
            ("gate_up_proj", (count, h, 2 * width)), ("gate_up_proj_bias", (count, 2 * width)),
            ("down_proj", (count, width, h)), ("down_proj_bias", (count, h)))}
        f = lambda v: g.const(v, np.float32)  # noqa: E731
        out = None
        for j in range(count):
            pick = {name: g.op("Gather", t, g.const(j), axis=0) for name, t in stacks.items()}
            gate_up = g.op("Add", g.op("MatMul", n, pick["gate_up_proj"]),
                           pick["gate_up_proj_bias"])
            gate = g.op("Slice", gate_up, g.const([0]), g.const([2 * width]), g.const([-1]),
                        g.const([2]))
            up = g.op("Slice", gate_up, g.const([1]), g.const([2 * width]), g.const([-1]),
                      g.const([2]))
            gate = g.op("Clip", gate, "", f(a.swiglu_limit))
            up = g.op("Clip", up, f(-a.swiglu_limit), f(a.swiglu_limit))
            glu = g.op("Mul", gate, g.op("Sigmoid", g.op("Mul", gate, f(a.swiglu_alpha))))
            y = g.op("Add", g.op("MatMul", g.op("Mul", g.op("Add", up, f(1.0)), glu),
                                 pick["down_proj"]), pick["down_proj_bias"])
            y = g.op("Mul", y, self.slice_last(weights, j, j + 1))
            out = y if out is None else g.op("Add", out, y)
        return out

    def routed_by_moe_op(self, p: str, n: str) -> str:
        """A routed layer as one com.microsoft.MoE node: the router's logits in, the kernel's
        softmax over all experts and its top k (renormalized: a softmax over the top-k logits,
        as GPT-OSS routes), then each chosen expert's SwiGLU MLP only. The kernel takes gate and
        up interleaved row by row ([E, 2W, H]) and down as [E, H, W]: the stacks are built here
        from the exported tensors by Transposes and Concats of initializers, which ONNX
        Runtime's optimizer folds into single weights when the artifact is built.

        SwiGLU is gate * sigmoid(alpha * gate) * (up + beta), gate clamped at `limit` and up
        within +-limit: SiLU gating is alpha 1, beta 0 and no limit; GPT-OSS's is its
        swiglu_alpha, beta 1 and swiglu_limit."""
        g, a = self.g, self.a
        h, width, count = a.hidden_size, a.expert_intermediate_size, a.num_experts
        if a.stacked_experts:
            x = f"{p}.experts"
            logits = self.linear(n, f"{p}.router", h, count, True)
            fc1 = g.op("Transpose", self.load(f"{x}.gate_up_proj", (count, h, 2 * width),
                                              False), perm=[0, 2, 1])  # [E, 2W, H]
            fc2 = g.op("Transpose", self.load(f"{x}.down_proj", (count, width, h), False),
                       perm=[0, 2, 1])  # [E, H, W]
            biases = [self.load(f"{x}.gate_up_proj_bias", (count, 2 * width), False),
                      self.load(f"{x}.down_proj_bias", (count, h), False)]
            activation = {"activation_alpha": a.swiglu_alpha, "activation_beta": 1.0,
                          "swiglu_limit": a.swiglu_limit}
            normalize = True
        else:
            _, gate_name, up_name, down_name = a.moe_names
            logits = self.linear(n, f"{p}.gate", h, count, False)
            rows, downs = [], []
            for j in range(count):
                x = f"{p}.experts.{j}"
                gate, up = (g.op("Unsqueeze", self.load(f"{x}.{name}.weight", (width, h), True),
                                 g.const([-1])) for name in (gate_name, up_name))  # [H, W, 1]
                # [1, H, 2W]: gate and up columns interleaved
                rows.append(g.op("Reshape", g.op("Concat", gate, up, axis=-1),
                                 g.const([1, h, 2 * width])))
                downs.append(g.op("Unsqueeze", self.load(f"{x}.{down_name}.weight", (h, width),
                                                         True), g.const([0])))  # [1, W, H]
            fc1 = g.op("Transpose", g.op("Concat", *rows, axis=0), perm=[0, 2, 1])
            fc2 = g.op("Transpose", g.op("Concat", *downs, axis=0), perm=[0, 2, 1])
            biases = ["", ""]
            activation = {"activation_alpha": 1.0, "activation_beta": 0.0}
            normalize = a.norm_topk_prob
        router = g.op("Reshape", logits, g.const([-1, count]))  # [B*S, E]: the kernel's form
        out = g._name("moe")
        g.nodes.append(helper.make_node(
            "MoE", [n, router, fc1, biases[0], fc2, biases[1]], [out], domain=MS,
            name=f"n{len(g.nodes)}_MoE", k=a.experts_per_token, activation_type="swiglu",
            swiglu_fusion=1, normalize_routing_weights=int(normalize), **activation))
        return out

"""Turbo heads compiled into the target's graph (QEfficient's multi-projection speculator).

The N hidden states the logits are kept for ([B, N, H], after the final norm) are stacked with
each head's output, head h being one ResBlock y + SiLU(y W_h^T + b_h) repeated `layers` times
with the same weights, into [B, N, heads + 1, H]; the target's LM head then gives
[B, N, heads + 1, V]: index 0 the base model's logits, index h the token h + 1 places further.
Both graph forms call this: the portable export writes the weights, the ONNX Runtime lowering
reads them back under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.turbo_heads import TurboHeads, weight_name
from .builder import GraphBuilder


@dataclass(frozen=True)
class TurboGraph:
    """The heads as graph weights: per head the names of W^T [H, H] and b [H]."""
    heads: tuple[tuple[str, str], ...]
    layers: int


def graph_names(head: int) -> tuple[str, str]:
    """The graph's names of head `head`'s W^T and b (those of its first stored layer: the
    others are equal, and the graph holds one copy)."""
    return f"{weight_name(head, 0, 'weight')}^T", weight_name(head, 0, "bias")


def write_turbo_weights(g: GraphBuilder, heads: TurboHeads) -> TurboGraph:
    names = []
    for h, (w, b) in enumerate(zip(heads.weights, heads.biases)):
        w_name, b_name = graph_names(h)
        names.append((g.weight(w_name, w.T), g.weight(b_name, b)))
    return TurboGraph(tuple(names), heads.info.num_layers)


def turbo_stack(g: GraphBuilder, x: str, turbo: TurboGraph) -> str:
    """[B, N, H] -> [B, N, heads + 1, H]: x, then each head's ResBlocks over x."""
    stacked = [x]
    for w, b in turbo.heads:
        y = x
        for _ in range(turbo.layers):
            z = g.op("Add", g.op("MatMul", y, w), b)
            y = g.op("Add", y, g.op("Mul", z, g.op("Sigmoid", z)))  # y + SiLU(z)
        stacked.append(y)
    return g.op("Concat", *[g.op("Unsqueeze", s, g.const([2])) for s in stacked], axis=2)

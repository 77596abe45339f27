"""The decoder graph's inputs and outputs, declared once: the exporter and the ONNX Runtime
lowering declare their graphs from it, and the plan records it in the manifest (the runtime
checks a loaded graph against that record, and qaic's custom_io.yaml is derived from it).

Dims are named as QEfficient names them; a lowering with fixed shapes passes the values it
fixes (`fixed`). The graph computes in float32 whatever the stored weights' dtype (float16
weights are Cast up), so its KV I/O is float32; on the card custom_io.yaml sets the KV
buffers' precision."""

from __future__ import annotations

from .arch import ArchSpec


def graph_io(role: str, arch: ArchSpec, continuous_batching: bool,
             turbo_heads: int = 0, eagle3_features: bool = False) -> dict[str, list[dict]]:
    """{"inputs": [...], "outputs": [...]}, each {"name", "dtype", "shape"}, in graph order.
    turbo_heads (a target with turbo heads compiled in): the logits gain an axis of the base
    model and the heads, [B, N, heads + 1, V] (QEfficient's turbo form; index 0 = the base).
    eagle3_features (a target an EAGLE-3 head reads): one more output, the head's input feature
    at every position of the call, [B, S, H] (export/eagle3.py)."""
    kv_batch = "full_batch_size" if continuous_batching else "batch_size"
    kv_shape = [kv_batch, arch.num_kv_heads, "ctx_len", arch.head_dim]
    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["batch_size", "seq_len"]},
              {"name": "position_ids", "dtype": "int64", "shape": ["batch_size", "seq_len"]}]
    if continuous_batching:
        inputs.append({"name": "batch_index", "dtype": "int64", "shape": ["batch_size", 1]})
    stack = [turbo_heads + 1] if turbo_heads and role == "target" else []
    outputs = [{"name": "logits", "dtype": "float32",
                "shape": ["batch_size", "num_logits_to_keep" if role == "target" else 1,
                          *stack, arch.vocab_size]}]
    for i in range(arch.num_layers):
        for kind in ("key", "value"):
            inputs.append({"name": f"past_{kind}.{i}", "dtype": "float32", "shape": kv_shape})
            outputs.append({"name": f"past_{kind}.{i}_RetainedState", "dtype": "float32",
                            "shape": kv_shape})
    if role == "target":
        inputs.append({"name": "num_logits_to_keep", "dtype": "int64",
                       "shape": ["num_logits_to_keep", 1]})
        if eagle3_features:  # (its name: export/eagle3.py's FEATURE_OUTPUT)
            outputs.append({"name": "eagle3_hidden", "dtype": "float32",
                            "shape": ["batch_size", "seq_len", arch.hidden_size]})
    return {"inputs": inputs, "outputs": outputs}


def declare(g, entries: list[dict], output: bool, fixed: dict[str, int] | None = None) -> dict:
    """Declare `entries` as the graph builder `g`'s inputs (or outputs), with the dims in
    `fixed` replaced by their values; returns {name: the graph value's name}."""
    from onnx import TensorProto  # only graph building needs onnx, not the plan's graph_io

    elem_types = {"int64": TensorProto.INT64, "float32": TensorProto.FLOAT}
    fixed = fixed or {}
    made = {}
    for e in entries:
        shape = [fixed.get(d, d) if isinstance(d, str) else d for d in e["shape"]]
        if output:
            g.output(e["name"], elem_types[e["dtype"]], shape)
            made[e["name"]] = e["name"]
        else:
            made[e["name"]] = g.input(e["name"], elem_types[e["dtype"]], shape)
    return made


def eagle3_head_io(hidden_size: int, num_kv_heads: int, head_dim: int, draft_vocab_size: int,
                   continuous_batching: bool) -> dict[str, list[dict]]:
    """The card form of an EAGLE-3 head's graph (export/eagle3_card.py), in graph_io's form: the
    token and the H-wide hidden at each position, its one layer's KV as retained state, and
    the logits over the draft vocabulary with the hidden the next draft step reads."""
    kv_batch = "full_batch_size" if continuous_batching else "batch_size"
    kv_shape = [kv_batch, num_kv_heads, "ctx_len", head_dim]
    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["batch_size", "seq_len"]},
              {"name": "hidden", "dtype": "float32",
               "shape": ["batch_size", "seq_len", hidden_size]},
              {"name": "position_ids", "dtype": "int64", "shape": ["batch_size", "seq_len"]}]
    if continuous_batching:
        inputs.append({"name": "batch_index", "dtype": "int64", "shape": ["batch_size", 1]})
    outputs = [{"name": "logits", "dtype": "float32",
                "shape": ["batch_size", "seq_len", draft_vocab_size]},
               {"name": "hidden_out", "dtype": "float32",
                "shape": ["batch_size", "seq_len", hidden_size]}]
    for kind in ("key", "value"):
        inputs.append({"name": f"past_{kind}.0", "dtype": "float32", "shape": kv_shape})
        outputs.append({"name": f"past_{kind}.0_RetainedState", "dtype": "float32",
                        "shape": kv_shape})
    return {"inputs": inputs, "outputs": outputs}

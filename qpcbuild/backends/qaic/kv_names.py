"""The KV buffers' names of a disaggregated bundle's card units, as vllm-qaic names them.

vllm-qaic compiles a model with QEfficient's `kv_cache_prefix` whenever the server has a
kv_transfer_config (model_loader/qaic.py, `_get_qaic_compile_config`: `VLLM_KV_CACHE_PREFIX =
"vllmKvCache"`), and its session finds the buffers it slices for the QaicConnector by that
infix in their names (model_loader/qaic_session_np.py, `_is_kv_cache_name`). QEfficient puts the
infix before the retained-state suffix (utils/_utils.py, `apply_kv_cache_prefix` and
`align_kv_input_names_to_retained_outputs`): the input `past_key.0` becomes
`past_key.0_vllmKvCache` and its output `past_key.0_RetainedState` becomes
`past_key.0_vllmKvCache_RetainedState`. The draft of a decode node is compiled from a copy of
the node's config (worker/model_runner.py: `config_replace(self.vllm_config, ...)`), which keeps
the kv_transfer_config, so its buffers carry the infix too, although its KV is never moved.

The ONNX Runtime units keep the exported names: only the card graph is renamed, written beside
the exported one so that it shares its weights file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

RETAINED = "_RetainedState"
KV_PREFIXES = ("past_key.", "past_value.")
GRAPH_FILE = "model.onnx"


def is_kv_name(name: str) -> bool:
    return name.startswith(KV_PREFIXES)


def card_kv_name(name: str, infix: str) -> str:
    """`past_key.3` -> `past_key.3_<infix>`; `past_key.3_RetainedState` ->
    `past_key.3_<infix>_RetainedState`; other names unchanged."""
    if not is_kv_name(name):
        return name
    if name.endswith(RETAINED):
        return f"{name[:-len(RETAINED)]}_{infix}{RETAINED}"
    return f"{name}_{infix}"


def card_graph_file(infix: str | None) -> str:
    """The graph file a card unit compiles, in its model role's onnx/ folder."""
    return GRAPH_FILE if infix is None else f"model.{infix}.onnx"


def _rename_in(graph: Any, mapping: dict[str, str]) -> None:
    """Every reference to a renamed value: graph I/O, node I/O, value_info, and subgraphs
    (an If or Loop body may read an outer value by name)."""
    for values in (graph.input, graph.output, graph.value_info):
        for v in values:
            v.name = mapping.get(v.name, v.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = mapping.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = mapping.get(name, name)
        for attr in node.attribute:
            if attr.HasField("g"):
                _rename_in(attr.g, mapping)
            for sub in attr.graphs:
                _rename_in(sub, mapping)


def write_card_graph(onnx_dir: Path, infix: str) -> tuple[list[str], list[str]]:
    """Write onnx_dir/model.<infix>.onnx: the exported graph with its KV inputs and their
    retained outputs renamed. Only the graph's structure is rewritten; its weights stay in the
    exported graph's external data file, which the new file names by the same relative path.
    Returns the new graph's input and output names, read back from the written file."""
    import onnx  # imported only when a card graph is written

    model = onnx.load(str(onnx_dir / GRAPH_FILE), load_external_data=False)
    names = [v.name for v in (*model.graph.input, *model.graph.output)]
    _rename_in(model.graph, {n: card_kv_name(n, infix) for n in names if is_kv_name(n)})
    out = onnx_dir / card_graph_file(infix)
    onnx.save_model(model, str(out))
    written = onnx.load(str(out), load_external_data=False)
    return [v.name for v in written.graph.input], [v.name for v in written.graph.output]

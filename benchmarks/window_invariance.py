"""Does a token's result depend on how many tokens its call carries? (issue 47)

Speculation reproduces target-only only if a token's target logits are the same whether the
token comes alone (a target-only decode step) or inside a verify window of K+1. This measures,
for M and M' in {1, 2, 3, 5}, the largest |difference| between row r of an M-token call and
row r of an M'-token call from the same KV state:

- one com.microsoft.MatMulNBits node (int4 blocks of 32, SmolLM2's gate/up shape), with float
  math (accuracy_level 0) and with int8 activations (4), plus whether a row's result moves when
  the other rows of its call change;
- the recipe's target lowered for ONNX Runtime as float32, int4 with float math and int4 with
  int8 activations: the logits and, to find where a difference starts, layer 0's qkv
  projection, its attention (GroupQueryAttention) and MLP output, and the last layer's
  attention.

    python benchmarks/window_invariance.py recipes/smollm2.yaml --json-out w.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WINDOWS = (1, 2, 3, 5)
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
FOLLOW = " if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def _session(model, threads: int = 2):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString() if hasattr(model, "SerializeToString")
                                else str(model), so, providers=["CPUExecutionProvider"])


def pairs(rows: dict[int, np.ndarray]) -> dict[str, float]:
    """'M v M'': max |difference| over the rows both calls have, for every M < M'."""
    return {f"{a}v{b}": float(max(np.abs(rows[a][r] - rows[b][r]).max() for r in range(a)))
            for a in WINDOWS for b in WINDOWS if a < b}


def node_rows(k: int = 576, n: int = 3072, seed: int = 0) -> dict:
    from onnx import TensorProto, helper, numpy_helper

    from qpcbuild.backends.onnxruntime.nbits import blockwise_nbits

    rng = np.random.default_rng(seed)
    packed, scales = blockwise_nbits(rng.normal(0, 0.05, (k, n)).astype(np.float32), 4)
    x = rng.normal(size=(max(WINDOWS), k)).astype(np.float32)
    out = {}
    for level in (0, 4):
        node = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft",
                                K=k, N=n, bits=4, block_size=32, accuracy_level=level)
        graph = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
            [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s")])
        sess = _session(helper.make_model(graph, opset_imports=[
            helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]))
        rows = {m: sess.run(None, {"a": x[:m]})[0] for m in WINDOWS}
        other = x[:max(WINDOWS)].copy()
        other[1:] *= 100.0  # the other rows 100x larger: a per-tensor scale would move row 0
        moved = float(np.abs(sess.run(None, {"a": other})[0][0] - rows[max(WINDOWS)][0]).max())
        out[f"accuracy_level {level}"] = {**pairs(rows), "row 0 when the others change": moved}
    return out


def lowered(recipe: Path, work: Path) -> dict[str, Path]:
    """The recipe's target as ONNX Runtime graphs: float32, int4 float math, int4 int8
    activations (the layouts of nbits.py)."""
    import onnx

    from qpcbuild.backends.onnxruntime.nbits import LEGACY_NBITS, NbitsLayout
    from qpcbuild.backends.onnxruntime.ort_graph import PortableWeights, build_ort_graph
    from qpcbuild.export import GRAPH_FILE, export_model
    from qpcbuild.models.source import resolve
    from qpcbuild.plan import make_plan
    from qpcbuild.recipe import load_recipe

    plan = make_plan(load_recipe(recipe, []))
    role = plan.target
    export_model(resolve(str(role.source.folder()), role.source.revision, allow_known=False),
                 "target", work / "export")
    portable = PortableWeights(work / "export" / GRAPH_FILE)
    meta = {p.key: p.value for p in onnx.load(str(work / "export" / GRAPH_FILE),
                                              load_external_data=False).metadata_props}
    out = {}
    for name, weights, layout in (("float32", "float32", LEGACY_NBITS),
                                  ("int4, float math", "int4", NbitsLayout(accuracy_level=0)),
                                  ("int4, int8 activations", "int4", LEGACY_NBITS)):
        out[name] = build_ort_graph(role.arch, portable, "target", 1, plan.recipe.shapes.ctx_len,
                                    work / name.replace(" ", "_").replace(",", ""),
                                    {**meta, "ort_graph": "fused"}, weights, layout=layout)
    return out


def with_probes(path: Path):
    """The graph with a few inner values as extra outputs (names of what they are)."""
    import onnx

    model = onnx.load(str(path))
    nodes = model.graph.node
    attn = [x for x in nodes if x.op_type == "GroupQueryAttention"]
    mm = [x for x in nodes if x.op_type in ("MatMul", "MatMulNBits")]
    probes = {"layer 0 qkv": mm[0].output[0], "layer 0 attention": attn[0].output[0],
              "layer 0 mlp": mm[3].output[0], "last layer attention": attn[-1].output[0]}
    for value in probes.values():
        model.graph.output.append(onnx.helper.make_tensor_value_info(value, onnx.TensorProto.FLOAT,
                                                                     None))
    return model, list(probes)


def graph_rows(path: Path, prompt: list[int], follow: list[int]) -> dict:
    model, probes = with_probes(path)
    sess = _session(model)
    kv_inputs = [i for i in sess.get_inputs() if i.name.startswith("past_")]

    def call(kv: dict, ids: list[int], start: int) -> tuple[dict, list[np.ndarray]]:
        m = len(ids)
        outs = sess.run(None, {"input_ids": np.array([ids], np.int64),
                               "position_ids": np.arange(start, start + m)[None],
                               "num_logits_to_keep": np.zeros((m, 1), np.int64), **kv})
        names = [o.name for o in sess.get_outputs()]
        got = dict(zip(names, outs))
        return {k: got[f"{k}_RetainedState"] for k in kv}, outs[:1] + outs[-len(probes):]

    empty = {i.name: np.zeros(i.shape, np.float32) for i in kv_inputs}
    after_prompt, _ = call(empty, prompt, 0)
    found = {m: call({k: v.copy() for k, v in after_prompt.items()}, follow[:m], len(prompt))[1]
             for m in WINDOWS}
    return {what: pairs({m: found[m][j][0] for m in WINDOWS})
            for j, what in enumerate(["logits"] + probes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from qpcbuild.plan import make_plan
    from qpcbuild.recipe import load_recipe

    folder = make_plan(load_recipe(args.recipe, [])).target.source.folder()
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt, follow = tok(PROMPT)["input_ids"], tok(FOLLOW)["input_ids"]
    work = Path(tempfile.mkdtemp(prefix="qpcbuild-window-"))
    try:
        report = {"recipe": str(args.recipe), "windows": list(WINDOWS),
                  "matmulnbits_node": node_rows(),
                  "target_graph": {name: graph_rows(path, prompt, follow)
                                   for name, path in lowered(args.recipe, work).items()}}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for part in ("matmulnbits_node", "target_graph"):
        for name, table in report[part].items():
            print(f"{part}: {name}")
            for what, diffs in (table.items() if part == "target_graph" else [("", table)]):
                print(f"  {what:22} " + "  ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""`qpcbuild doctor`: does a card graph look like the graphs the Cloud AI compiler is proven on?

No card is needed to know whether a graph is one the compiler has seen before: QEfficient's own
exports are what it is proven on. Their form, recorded from QEfficient's exports of small
Llama / Qwen2 / Qwen3 / Mistral models (SmolLM2-135M too when recorded) as TLM targets, drafts and
continuous-batching variants by scripts/record_qeff_dialect.py, is shipped as
qpcbuild/data/qefficient_dialect.json. The doctor compares a graph's form
(qpcbuild/export/graph_form.py) with the union of those recordings and flags each departure:

- an opset or IR version QEfficient does not export;
- a top-level op QEfficient never emits, or emits only inside its functions (ScatterND, say);
- an op whose attributes QEfficient never writes that way (`Shape` with `start`/`end`);
- a function with another name, domain, input order, attribute set or body;
- a function called differently: an input produced by something QEfficient never feeds it
  (a pad position reaching `CtxScatterCB` without the INT32_MAX substitution, an invalid gather
  index other than INT32_MAX), a scatter whose output is not the retained-state graph output;
- a Cast of a stored weight in front of a MatMul (the compiler compresses constant MatMul
  weights; QEfficient's MatMuls take their weights directly);
- in a bundle, KV I/O dtypes in the manifest that differ from the graph's.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BundleError, UsageError
from ..export.graph_form import graph_form
from .manifest import Manifest, RoleIO

if TYPE_CHECKING:
    import onnx

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "qefficient_dialect.json"

# Families whose card graph as a verify target is qpcbuild's own form: QEfficient's SpDTransform
# makes speculative targets of Llama, Qwen2 and Qwen3 only, and none of its recorded exports is of
# these families, so the FLAG lines of such a graph are expected and say what is new to the
# compiler. By the architecture the graph's metadata names. (Mistral's recorded export is
# QEfficient's; a Mistral graph with an active window adds the window mask's ops.)
OWN_FORMS = {
    "Gemma3ForCausalLM": "Gemma 3 as a verify target is qpcbuild's own graph (QEfficient exports "
    "Gemma 3 as a plain causal LM, with a separate window-sized cache for its sliding layers): "
    "sliding layers mask keys at or past the window behind each query over the full ctx_len "
    "buffer (LessOrEqual, Or), GELU is written with Tanh, the norms' (1 + w) weights are folded "
    "into their initializers, the attention output and the MLP's input and output are normed",
    "Gemma2ForCausalLM": "Gemma 2 as a verify target is qpcbuild's own graph (no recorded "
    "QEfficient export): sliding layers mask over the full ctx_len buffer (LessOrEqual, Or), "
    "GELU and the soft-capping of scores and logits are written with Tanh, the norms' (1 + w) "
    "weights are folded into their initializers",
    "GraniteForCausalLM": "Granite as a verify target is qpcbuild's own graph: Llama's block with "
    "its four multipliers as Muls and a Div of the logits; QEfficient's Granite export has not "
    "been recorded here",
    "Phi3ForCausalLM": "Phi-3 as a verify target is qpcbuild's own graph: one MatMul of the fused "
    "qkv / gate_up weights, Sliced, and RoPE on the rotary part only; QEfficient's Phi-3 export "
    "has not been recorded here",
    "Qwen3MoeForCausalLM": "Qwen3-MoE as a verify target is qpcbuild's own graph: an exact dense "
    "routed block (TopK, ScatterElements, every expert on every token), not QEfficient's MoE "
    "form, which has not been recorded here",
    "MixtralForCausalLM": "Mixtral as a verify target is qpcbuild's own graph: an exact dense "
    "routed block (TopK, ScatterElements, every expert on every token) and a sliding-window "
    "mask over the full buffer, not QEfficient's form, which has not been recorded here",
    "Eagle3Speculator": "An EAGLE-3 head's card graph is qpcbuild's own (QEfficient's EAGLE-3 "
    "export has not been recorded here): one Llama layer whose q/k/v read the token's embedding "
    "and the `hidden` graph input side by side, so a CustomRMSNorm takes a graph input, and "
    "whose logits cover the draft vocabulary at every position",
    "GptOssForCausalLM": "GPT-OSS as a verify target is qpcbuild's own graph: attention sinks as "
    "a Concat column of the softmax, a windowed mask over the full buffer, YaRN in the RoPE "
    "tables, experts Gathered from their stacks and run densely with a Clip-clamped SwiGLU; "
    "QEfficient's GPT-OSS export has not been recorded here",
}


@lru_cache(maxsize=None)
def reference(path: Path = REFERENCE) -> dict[str, Any]:
    """The union of QEfficient's recorded graph forms."""
    graphs = json.loads(path.read_text())["graphs"]
    top: dict[str, set[str]] = {}
    inside: dict[str, set[str]] = {}
    functions: dict[str, dict[str, Any]] = {}
    for form in graphs.values():
        for op, forms in form["top_level"].items():
            top.setdefault(op, set()).update(forms)
        for name, f in form["functions"].items():
            for body_op in f["body_ops"]:
                inside.setdefault(body_op, set()).add(name)
            ref = functions.setdefault(name, {
                "signature": (f["domain"], f["inputs"], f["attributes"]), "bodies": [],
                "called_with": [set() for _ in f["inputs"]], "output_is_graph_output": set()})
            if f["body"] not in ref["bodies"]:
                ref["bodies"].append(f["body"])
            for seen, sources in zip(ref["called_with"], f["called_with"]):
                seen.update(sources)
            ref["output_is_graph_output"].update(f["output_is_graph_output"])
    return {"opsets": {json.dumps(g["opsets"], sort_keys=True) for g in graphs.values()},
            "ir_versions": {g["ir_version"] for g in graphs.values()},
            "top": top, "inside": inside, "functions": functions,
            "weight_casts": max(g["casts_of_weights_into_matmul"] for g in graphs.values()),
            "recorded": sorted(graphs)}


def _body_difference(ours: list[str], theirs: list[list[str]]) -> str:
    best = min(theirs, key=lambda t: len(set(t) ^ set(ours)))
    extra = sorted(set(ours) - set(best))
    missing = sorted(set(best) - set(ours))
    counts = [f for f in sorted(set(ours) & set(best)) if ours.count(f) != best.count(f)]
    return "; ".join(part for part in (
        f"not in QEfficient's: {', '.join(extra)}" if extra else "",
        f"QEfficient's has: {', '.join(missing)}" if missing else "",
        f"other counts of: {', '.join(counts)}" if counts else "") if part)


def _function_findings(form: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    findings = []
    for name, f in form["functions"].items():
        want = ref["functions"].get(name)
        if want is None:
            findings.append(f"function {f['domain']}::{name} is not in QEfficient's vocabulary")
            continue
        domain, inputs, attributes = want["signature"]
        if (f["domain"], f["inputs"], f["attributes"]) != (domain, inputs, attributes):
            findings.append(f"function {name}: {f['domain']}({', '.join(f['inputs'])}; "
                            f"{', '.join(f['attributes'])}) differs from QEfficient's "
                            f"{domain}({', '.join(inputs)}; {', '.join(attributes)})")
            continue
        if f["body"] not in want["bodies"]:
            findings.append(f"function {name}: body differs from QEfficient's "
                            f"({_body_difference(f['body'], want['bodies'])})")
        for arg, ours, theirs in zip(inputs, f["called_with"], want["called_with"]):
            odd = sorted(set(ours) - theirs)
            if odd:
                findings.append(f"function {name} is called with {arg} from "
                                f"{', '.join(odd)}; QEfficient passes it from "
                                f"{', '.join(sorted(theirs))}")
        for odd in sorted(set(f["output_is_graph_output"]) - want["output_is_graph_output"]):
            findings.append(f"function {name}: a call's output is {'' if odd else 'not '}a "
                            "graph output, unlike in QEfficient's graphs")
    return findings


def _top_level_findings(form: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    findings = []
    for op, forms in form["top_level"].items():
        count = sum(forms.values())
        if "::" in op:
            domain, name = op.split("::")
            if form["functions"].get(name, {}).get("domain") != domain:
                findings.append(f"{op} ({count}x) is neither a standard op nor a function "
                                "defined in the model")
        elif op not in ref["top"]:
            where = ref["inside"].get(op)
            findings.append(f"op {op} ({count}x) at top level: QEfficient uses it only inside "
                            f"{', '.join(sorted(where))}" if where else
                            f"op {op} ({count}x) is not in QEfficient's exports")
        else:
            for variant, n in forms.items():
                if variant not in ref["top"][op]:
                    findings.append(f"op {variant} ({n}x): QEfficient writes {op} only as "
                                    f"{', '.join(sorted(ref['top'][op]))}")
    return findings


def check_model(model: onnx.ModelProto,
                ref: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The graph's form and the findings against QEfficient's recorded forms."""
    ref = ref or reference()
    form = graph_form(model)
    findings = []
    if json.dumps(form["opsets"], sort_keys=True) not in ref["opsets"]:
        findings.append(f"opsets {form['opsets']} (QEfficient exports "
                        f"{' or '.join(sorted(ref['opsets']))})")
    if form["ir_version"] not in ref["ir_versions"]:
        findings.append(f"IR version {form['ir_version']} (QEfficient's: "
                        f"{', '.join(map(str, sorted(ref['ir_versions'])))})")
    findings += _top_level_findings(form, ref)
    findings += _function_findings(form, ref)
    if form["casts_of_weights_into_matmul"] > ref["weight_casts"]:
        findings.append(f"{form['casts_of_weights_into_matmul']} MatMul weights reach their "
                        "MatMul through a Cast; QEfficient's MatMuls take stored weights "
                        "directly (what -mxfp6-matmul compresses)")
    return form, findings


def check_graph(path: Path, io: RoleIO | None = None) -> dict[str, Any]:
    """One ONNX file; `io`: the manifest's I/O signature of its role, checked against it."""
    import numpy as np
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except Exception as exc:  # onnx raises DecodeError and friends
        raise BundleError(f"{path}: not a readable ONNX model ({exc})") from None
    form, findings = check_model(model)
    architecture = {p.key: p.value for p in model.metadata_props}.get("architecture")
    if io is not None:
        dtypes = form["io_dtypes"]
        for entry in [*io.inputs, *io.outputs]:
            have = dtypes.get(entry.name)
            want = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(entry.dtype))
            if have is None:
                findings.append(f"the manifest lists I/O {entry.name}, the graph has none")
            elif have != want:
                findings.append(f"I/O {entry.name}: the manifest says {entry.dtype}, the "
                                f"graph {onnx.helper.tensor_dtype_to_np_dtype(have)}")
    return {"graph": str(path), "opsets": form["opsets"],
            "functions": {name: {k: f[k] for k in ("domain", "inputs", "attributes",
                                                   "body_ops")}
                          for name, f in form["functions"].items()},
            "ops": {op: sum(c.values()) for op, c in form["top_level"].items()},
            "findings": findings,
            **({"note": OWN_FORMS[architecture]} if architecture in OWN_FORMS else {})}


def doctor(target: Path, manifest: Manifest | None) -> dict[str, Any]:
    """A bundle (with its manifest) or, with `manifest` None, one loose .onnx file."""
    if manifest is None:
        try:
            report = check_graph(target)
        except BundleError as exc:  # a file the user named: bad input, not a damaged bundle
            raise UsageError(str(exc)) from None
        return {"graph": str(target), "roles": {"graph": report}, "checked": 1,
                "clean": not report["findings"]}
    roles: dict[str, dict[str, Any]] = {}  # by role, and by unit folder for a head
    for role, entry in manifest.roles.items():
        graph = target / role / "onnx" / "model.onnx"
        if graph.is_file():
            roles[role] = check_graph(graph, entry.io)
        else:
            roles[role] = {"graph": None, "findings": [], "note": "no card graph: the bundle was "
                           "built without the qaic backend (add qaic to backends, or "
                           "--emit-only where no SDK is installed)"}
        for built in entry.backends.values():  # a target's EAGLE-3 head, compiled beside it
            for unit, (path, io) in built.unit_graphs().items():
                roles[unit] = check_graph(target / path, RoleIO.model_validate(io))
    return {"bundle": str(target), "roles": roles,
            "checked": sum(r["graph"] is not None for r in roles.values()),
            "clean": all(not r["findings"] for r in roles.values())}

"""`qpcbuild doctor`: what each role's card graph asks of the Cloud AI compiler.

No card is needed to know whether a graph is one the compiler has seen before: QEfficient's
exports are what it is proven on. The doctor lists the ops, domains and model-local functions of
each card graph (role/onnx/model.onnx) and flags anything outside that vocabulary: an unknown
op, a function with another name, domain, input order or attribute set, an opset other than 17.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import BundleError
from ..export import dialect

# name -> (domain, inputs, attributes), as dialect.py builds them
SIGNATURES = {name: (f.domain, list(f.input), list(f.attribute))
              for name, f in ((n, build()) for n, build in dialect.FUNCTIONS.items())}


def check_graph(path: Path) -> dict[str, Any]:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and friends
        raise BundleError(f"{path}: not a readable ONNX model ({exc})") from None
    findings: list[str] = []
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    if opsets.get("ai.onnx") != dialect.OPSET:
        findings.append(f"opset {opsets.get('ai.onnx')} (QEfficient exports opset "
                        f"{dialect.OPSET})")
    functions = {}
    for f in model.functions:
        functions[f.name] = {"domain": f.domain, "inputs": list(f.input),
                             "attributes": list(f.attribute),
                             "body_ops": sorted({n.op_type for n in f.node})}
        want = SIGNATURES.get(f.name)
        if want is None:
            findings.append(f"function {f.domain}::{f.name} is not in QEfficient's vocabulary")
        elif want != (f.domain, list(f.input), list(f.attribute)):
            findings.append(f"function {f.name}: {f.domain}({', '.join(f.input)}; "
                            f"{', '.join(f.attribute)}) differs from QEfficient's "
                            f"{want[0]}({', '.join(want[1])}; {', '.join(want[2])})")
        findings += [f"function {f.name} uses op {n.op_type}" for n in f.node
                     if n.domain or n.op_type not in dialect.STANDARD_OPS]
    ops = Counter((n.domain or "ai.onnx", n.op_type) for n in model.graph.node)
    for (domain, op), count in sorted(ops.items()):
        if domain == "ai.onnx" and op not in dialect.STANDARD_OPS:
            findings.append(f"op {op} ({count}x) is not in QEfficient's export of this family")
        elif domain != "ai.onnx" and (op not in functions or functions[op]["domain"] != domain):
            findings.append(f"{domain}::{op} ({count}x) is neither a standard op nor a function "
                            "defined in the model")
    return {"graph": str(path), "opsets": opsets, "functions": functions,
            "ops": {f"{d}::{o}" if d != "ai.onnx" else o: c for (d, o), c in sorted(ops.items())},
            "findings": findings}


def doctor(bundle: Path, manifest: dict) -> dict[str, Any]:
    roles = {}
    for role in manifest["roles"]:
        graph = bundle / role / "onnx" / "model.onnx"
        if graph.is_file():
            roles[role] = check_graph(graph)
        else:
            roles[role] = {"graph": None, "findings": [], "note": "no card graph: the bundle was "
                           "built without the qaic backend (add qaic to backends, or "
                           "--emit-only where no SDK is installed)"}
    return {"bundle": str(bundle), "roles": roles,
            "checked": sum(r["graph"] is not None for r in roles.values()),
            "clean": all(not r["findings"] for r in roles.values())}

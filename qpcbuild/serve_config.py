"""Manifest -> what a Cloud AI deployment needs to serve the bundle with vLLM (vllm-qaic).

Every value comes from the manifest, so the server is configured for exactly what was compiled:
K, context, batch, precision, device groups and cores (reference, section 7).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from .errors import UsageError

DEFAULT_IMAGE = "ghcr.io/quic/cloud_ai_inference_vllm:latest"
FORMATS = ("vllm", "docker", "env", "legacy", "json")


def _speculative_config(m: dict[str, Any]) -> dict[str, Any] | None:
    spd = m["speculation"]
    k = max(spd["num_speculative_tokens"])
    if spd["method"] == "draft_model":
        return {"method": "draft_model", "model": served_model(m["roles"]["draft"]),
                "num_speculative_tokens": k}
    if k == 0:
        return None
    return {"method": spd["method"], "num_speculative_tokens": k, **spd["options"]}


def served_model(role: dict[str, Any]) -> str:
    """vLLM loads config and tokenizer by model id; smoke builds name the model they stand in for."""
    return role["source"].get("smoke_of") or role["source"]["ref"]


def _qaic_config(role: dict[str, Any]) -> dict[str, Any]:
    return {"device_group": role["device_group"], "num_cores": role["num_cores"]}


def qpc_env(m: dict[str, Any], bundle: Path) -> dict[str, str]:
    if "draft" in m["roles"]:
        return {"VLLM_QAIC_SPEC_TARGET_QPC_PATH": str(bundle / "target" / "qpc"),
                "VLLM_QAIC_SPEC_DRAFT_QPC_PATH": str(bundle / "draft" / "qpc")}
    return {"VLLM_QAIC_QPC_PATH": str(bundle / "target" / "qpc")}


def vllm_argv(m: dict[str, Any], legacy: bool = False, qpc_root: Path | None = None) -> list[str]:
    target = m["roles"]["target"]
    shapes = m["shapes"]
    argv = ["vllm", "serve", served_model(target), "--device", "qaic",
            "--max-model-len", str(shapes["ctx_len"]),
            "--max-num-seqs", str(shapes.get("full_batch_size") or shapes["batch_size"]),
            "--max-seq-len-to-capture", str(shapes["prefill_seq_len"])]
    precision = target["precision"]
    if precision["weights"] == "mxfp6":
        argv += ["--quantization", "mxfp6"]
    if precision["kv_cache"] == "mxint8":
        argv += ["--kv-cache-dtype", "mxint8"]
    spec = _speculative_config(m)
    if spec:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if legacy:  # older user guides pass the precompiled QPC through this flag
        root = qpc_root or Path(".")
        argv += ["--override-qaic-config", f"qpc_path={root / 'target' / 'qpc'}"]
    else:
        extra = {"override_qaic_config": _qaic_config(target)}
        if "draft" in m["roles"]:
            extra["draft_override_qaic_config"] = _qaic_config(m["roles"]["draft"])
        argv += ["--additional-config", json.dumps(extra, separators=(",", ":"))]
    return argv


def render(m: dict[str, Any], bundle: Path, fmt: str, image: str = DEFAULT_IMAGE) -> str:
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not '{fmt}'")
    if "qaic" not in m["backends"]:
        raise UsageError(f"{bundle}: built without the qaic backend; vLLM on Cloud AI needs QPCs "
                         "(add qaic to the recipe's backends)")
    statuses = {r: info["backends"]["qaic"]["status"] for r, info in m["roles"].items()}
    note = "" if all(s == "compiled" for s in statuses.values()) else \
        ("# note: QPCs not compiled yet (" + ", ".join(f"{r}: {s}" for r, s in statuses.items())
         + "); on a machine with the SDK run `bash <role>/qaic/compile.sh` in the bundle "
         "(it ends with `qpcbuild finish`) first\n")
    bundle = bundle.resolve()
    env = qpc_env(m, bundle)
    if fmt == "json":
        return json.dumps({"env": env, "vllm": vllm_argv(m), "legacy": vllm_argv(m, True, bundle),
                           "image": image}, indent=1) + "\n"
    if fmt == "env":
        return note + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    if fmt == "legacy":
        return note + shlex.join(vllm_argv(m, True, bundle)) + "\n"
    if fmt == "vllm":
        return note + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\\n  " + \
            shlex.join(vllm_argv(m)) + "\n"
    mounted = {k: v.replace(str(bundle), "/bundle") for k, v in env.items()}
    docker = ["docker", "run", "--rm", "-it", "--device", "/dev/accel/", "--shm-size", "4g",
              "-p", "8000:8000", "-v", f"{bundle}:/bundle:ro"]
    for k, v in mounted.items():
        docker += ["-e", f"{k}={v}"]
    return note + shlex.join(docker + [image] + vllm_argv(m)) + "\n"

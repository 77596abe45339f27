"""A bundle is an artifact people can trust: a sealed manifest, a cache that a bundle edit cannot
reach, ids that do not depend on the checkout, a hand-off to the SDK machine that closes, and
builds that survive kills and concurrency. Built on the shipped demo pair (models/demo)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

import qpcbuild.bundle.build as build_mod
import qpcbuild.bundle.keys as keys_mod
from qpcbuild.backends.qaic.finish import finish_bundle
from qpcbuild.bundle import build_bundle, read_manifest, verify_bundle
from qpcbuild.bundle import manifest as manifest_mod
from qpcbuild.bundle.manifest import MANIFEST
from qpcbuild.cache import Cache
from qpcbuild.cli import app
from qpcbuild.errors import BundleError
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe
from qpcbuild.runtime.loader import load

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
QPCBUILD = [sys.executable, "-m", "qpcbuild"]
runner = CliRunner()


def checkout(root: Path) -> Path:
    """What a CI farm's checkout holds of the project: the demo models and recipes."""
    shutil.copytree(REPO / "models" / "demo", root / "models" / "demo")
    shutil.copytree(REPO / "recipes", root / "recipes")
    return root


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    return checkout(tmp_path_factory.mktemp("checkout"))


def build(recipe: Path, cache: Path, out: Path, *overrides: str, say=None, **kw):
    plan = make_plan(load_recipe(recipe, list(overrides)))
    return build_bundle(plan, cache=Cache(cache, say=say), out=out, **kw)


def reuse(result) -> dict[str, bool]:
    return {s["stage"]: s["reused"] for s in result.stages}


def edit_manifest(bundle: Path, change, reseal: bool = False) -> None:
    """`reseal`: as someone who rewrote the id and seal with a tool of their own would."""
    m = json.loads((bundle / MANIFEST).read_text())
    change(m)
    if reseal:
        m["bundle_id"] = manifest_mod.content_id(m)
        m["seal"]["fields"] = manifest_mod._field_digests(m)
    (bundle / MANIFEST).write_text(json.dumps(m, indent=1))


def debris(out: Path, cache: Path) -> list[str]:
    beside = [p.name for p in out.parent.iterdir() if ".building-" in p.name or ".old-" in p.name]
    temp = [f"{k.name}/{p.name}" for k in cache.iterdir() if k.is_dir()
            for p in k.iterdir() if p.name.startswith(".")] if cache.is_dir() else []
    return beside + temp


@pytest.fixture
def demo(repo_copy, tmp_path) -> tuple[Path, Path]:
    """A built demo bundle and its cache."""
    out, cache = tmp_path / "demo", tmp_path / "cache"
    build(repo_copy / "recipes" / "demo.yaml", cache, out)
    return out, cache


# ---------------------------------------------------------------- the sealed manifest
@pytest.mark.parametrize("field,change", [
    ("name", lambda m: m.update(name="other")),
    ("shapes.ctx_len", lambda m: m["shapes"].update(ctx_len=1024)),
    ("roles.target.num_cores", lambda m: m["roles"]["target"].update(num_cores=16)),
    ("speculation.num_speculative_tokens", lambda m: m["speculation"].update(
        num_speculative_tokens=[0, 8])),
    ("toolchain.onnxruntime", lambda m: m["toolchain"].update(onnxruntime="0.0.1")),
    ("roles.draft.arch.vocab_size", lambda m: m["roles"]["draft"]["arch"].update(vocab_size=9)),
])
def test_editing_a_manifest_field_is_named_by_verify_and_refused_by_run(demo, field, change):
    out, _ = demo
    edit_manifest(out, change)
    problems = verify_bundle(out)
    assert f"manifest field changed: {field}" in problems
    result = runner.invoke(app, ["verify", str(out)])
    assert result.exit_code == 1 and field in result.output
    with pytest.raises(BundleError, match=field.replace(".", r"\.")):
        load(out)


def test_added_field_and_edited_id_are_reported(demo):
    out, _ = demo
    original = read_manifest(out).bundle_id
    edit_manifest(out, lambda m: m.update(extra={"x": 1}))
    assert verify_bundle(out) == ["manifest field added: extra.x"]
    edit_manifest(out, lambda m: m.pop("extra"))
    assert verify_bundle(out) == []
    edit_manifest(out, lambda m: m.update(bundle_id="0" * 64))
    assert any("bundle_id was edited" in p for p in verify_bundle(out))
    edit_manifest(out, lambda m: m.update(bundle_id=original))
    assert verify_bundle(out) == []


@pytest.mark.parametrize("path", ["../elsewhere/model.onnx", "/etc/passwd", "target/../../x"])
def test_an_artifact_path_outside_the_bundle_is_refused_even_when_resealed(demo, path):
    out, _ = demo
    field = "roles.target.backends.onnxruntime.artifact"

    def redirect(m):
        m["roles"]["target"]["backends"]["onnxruntime"]["artifact"] = path

    edit_manifest(out, redirect, reseal=True)
    for argv in (["verify", str(out)], ["run", str(out), "--prompt", "x", "--verify", "none"],
                 ["inspect", str(out)]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 1, argv
        assert field in result.output and "outside the bundle" in result.output


def test_an_artifact_path_must_be_one_of_the_sealed_files(demo):
    out, _ = demo
    (out / "target" / "ort" / "copy.onnx").write_bytes(b"x")

    def redirect(m):
        m["roles"]["target"]["backends"]["onnxruntime"]["artifact"] = "target/ort/copy.onnx"

    edit_manifest(out, redirect, reseal=True)
    with pytest.raises(BundleError, match="not one of the bundle's files"):
        read_manifest(out)


def test_verify_json_reports_each_problem(demo):
    out, _ = demo
    (out / "recipe.yaml").write_text("changed\n")
    result = runner.invoke(app, ["verify", str(out), "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == 1 and data["ok"] is False
    assert any("recipe.yaml" in p for p in data["problems"])


# ---------------------------------------------------------------- the cache cannot be poisoned
def test_flipping_a_bundle_byte_never_reaches_the_cache_or_the_next_build(demo, tmp_path):
    out, cache = demo
    original = read_manifest(out).bundle_id
    for f in out.rglob("*"):
        assert not f.is_file() or f.stat().st_nlink == 1, f"{f} is linked to another file"
    data = out / "target" / "ort" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert verify_bundle(out) == ["changed file: target/ort/model.onnx.data (sha256 differs "
                                  "from the manifest)"]
    again = build(REPO / "recipes" / "demo.yaml", cache, tmp_path / "again")
    assert again.bundle_id == original and all(reuse(again).values())
    assert verify_bundle(tmp_path / "again") == []
    assert runner.invoke(app, ["cache", "verify", "--cache-dir", str(cache)]).exit_code == 0
    # The onnx package opens the bundle's graph with its external data (it refuses hard links).
    model = onnx.load(str(tmp_path / "again" / "target" / "ort" / "model.onnx"))
    assert sum(len(t.raw_data) for t in model.graph.initializer) > 0


def test_a_damaged_cache_entry_is_reported_and_rebuilt(demo, tmp_path):
    out, cache = demo
    original = read_manifest(out).bundle_id
    entry = next((cache / "ort").iterdir())
    victim = next(p for p in entry.rglob("*.data"))
    victim.chmod(0o644)
    with open(victim, "r+b") as fh:
        fh.write(b"\x00\x01\x02\x03")
    result = runner.invoke(app, ["cache", "verify", "--cache-dir", str(cache)])
    assert result.exit_code == 1 and entry.name in result.output and "changed" in result.output
    said: list[str] = []
    again = build(REPO / "recipes" / "demo.yaml", cache, tmp_path / "again", say=said.append)
    assert again.bundle_id == original
    assert any(entry.name in s and "damaged" in s for s in said)
    assert runner.invoke(app, ["cache", "verify", "--cache-dir", str(cache)]).exit_code == 0


def test_cache_keys_follow_content_and_toolchain_not_paths_k_or_threads(repo_copy, tmp_path,
                                                                      monkeypatch):
    cache = tmp_path / "cache"
    recipe = repo_copy / "recipes" / "demo.yaml"
    first = build(recipe, cache, tmp_path / "a")
    # Another K and other thread counts: the onnxruntime artifacts do not change.
    other_k = build(recipe, cache, tmp_path / "b", "speculation.num_speculative_tokens=[0,2]",
                    "onnxruntime.intra_op_threads=1")
    assert all(reuse(other_k).values()), reuse(other_k)
    # The same models moved to another folder (new paths, inodes and times): still reused.
    moved = checkout(tmp_path / "moved")
    again = build(moved / "recipes" / "demo.yaml", cache, tmp_path / "c")
    assert all(reuse(again).values()) and again.bundle_id == first.bundle_id
    # A new onnxruntime: the ORT artifacts are rebuilt (and credited to it), exports reused.
    real = keys_mod.artifact_versions
    for module in (keys_mod, build_mod):  # the cache keys, and the manifest's tool versions
        monkeypatch.setattr(module, "artifact_versions",
                            lambda: {**real(), "onnxruntime": "99.0"})
    newer = build(recipe, cache, tmp_path / "d")
    assert reuse(newer) == {"export target": True, "export draft": True,
                            "onnxruntime target": False, "onnxruntime draft": False}
    # Changed weights (same path, same size): the export is rebuilt.
    weights = moved / "models" / "demo" / "draft" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0x01
    weights.write_bytes(bytes(raw))
    changed = build(moved / "recipes" / "demo.yaml", cache, tmp_path / "e")
    assert not reuse(changed)["export draft"] and reuse(changed)["export target"]


def test_cache_ls_and_prune(demo, tmp_path):
    _, cache = demo
    listed = [e for e in json.loads(runner.invoke(app, ["cache", "ls", "--cache-dir",
                                                         str(cache), "--json"]).stdout)
              if e["kind"] != "other"]  # (the cache's locks and weight digests)
    assert sorted({e["kind"] for e in listed}) == ["exports", "ort"] and len(listed) == 4
    stale = cache / "exports" / f".{listed[0]['key']}.abc123"
    stale.mkdir()
    (stale / "half.onnx").write_bytes(b"half")
    result = runner.invoke(app, ["cache", "prune", "--cache-dir", str(cache)])
    assert result.exit_code == 0 and "debris" in result.output and not stale.exists()
    assert len([e for e in json.loads(runner.invoke(app, ["cache", "ls", "--cache-dir",
                                                          str(cache), "--json"]).stdout)
                if e["kind"] != "other"]) == 4
    result = runner.invoke(app, ["cache", "prune", "--cache-dir", str(cache), "--days", "0"])
    assert "4 removed" in result.output



@pytest.mark.parametrize("backends", ["[onnxruntime]", "[qaic,onnxruntime]"])
def test_no_cache_builds_the_same_bundle_and_leaves_nothing_behind(repo_copy, tmp_path,
                                                                   monkeypatch, backends):
    """--no-cache moves fresh artifacts into the bundle: same files and id as a cached build,
    no cache folder created, no scratch or smoke folder left anywhere."""
    recipe = str(repo_copy / "recipes" / "demo.yaml")
    args = ["--set", f"backends={backends}", "--emit-only", "--json"]
    cached = runner.invoke(app, ["compile", recipe, "-o", str(tmp_path / "cached"),
                                 "--cache-dir", str(tmp_path / "cache"), *args])
    assert cached.exit_code == 0, cached.output
    default_cache, temp = tmp_path / "default-cache", tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("QPCBUILD_CACHE", str(default_cache))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)  # TMPDIR is read again
    fresh = runner.invoke(app, ["compile", recipe, "-o", str(tmp_path / "fresh"), "--no-cache",
                                *args])
    assert fresh.exit_code == 0, fresh.output
    assert json.loads(fresh.stdout)["bundle_id"] == json.loads(cached.stdout)["bundle_id"]
    assert verify_bundle(tmp_path / "fresh") == []
    assert read_manifest(tmp_path / "fresh").files == read_manifest(tmp_path / "cached").files
    assert not default_cache.exists() and list(temp.iterdir()) == []
    assert debris(tmp_path / "fresh", default_cache) == []


def test_no_cache_with_smoke_weights_keeps_no_random_checkpoint(repo_copy, tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("QPCBUILD_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    result = runner.invoke(app, ["compile", str(repo_copy / "recipes" / "demo.yaml"), "-o",
                                 str(tmp_path / "smoke"), "--no-cache", "--smoke-weights"])
    assert result.exit_code == 0, result.output
    assert read_manifest(tmp_path / "smoke").target.source.smoke_weights
    assert list(temp.iterdir()) == [] and not (tmp_path / "default-cache").exists()


@pytest.mark.parametrize("flags,named", [(["--cache-dir", "c"], "--cache-dir"),
                                         (["--tune"], "--tune")])
def test_no_cache_refuses_flags_that_need_a_cache(repo_copy, tmp_path, flags, named):
    result = runner.invoke(app, ["compile", str(repo_copy / "recipes" / "demo.yaml"), "-o",
                                 str(tmp_path / "b"), "--no-cache", *flags])
    assert result.exit_code == 2 and named in result.output and not (tmp_path / "b").exists()

# ---------------------------------------------------------------- reproducible across machines
def _compile_and_package(root: Path, cache: Path, umask: int) -> tuple[str, bytes]:
    env = {**os.environ, "QPCBUILD_CACHE": str(cache), "TZ": "Asia/Kolkata"}
    code = (f"import os, sys; os.umask({umask:#o}); sys.argv = ['qpcbuild', *sys.argv[1:]]; "
            "from qpcbuild.cli import app; app()")
    out = subprocess.run([sys.executable, "-c", code, "compile", "recipes/demo.yaml", "--json"],
                         cwd=root, env=env, capture_output=True, text=True, check=True)
    bundle_id = json.loads(out.stdout)["bundle_id"]
    subprocess.run([sys.executable, "-c", code, "package", "build/demo", "-o", "demo.tar.gz"],
                   cwd=root, env=env, capture_output=True, check=True)
    return bundle_id, (root / "demo.tar.gz").read_bytes()


def test_two_checkouts_at_different_paths_build_the_same_id_and_archive(tmp_path):
    a = checkout(tmp_path / "a")
    b = checkout(tmp_path / "ci" / "runner-7" / "work" / "qpcbuild")
    id_a, tar_a = _compile_and_package(a, tmp_path / "cache-a", 0o022)
    time.sleep(1.1)  # a different second on the clock
    id_b, tar_b = _compile_and_package(b, tmp_path / "cache-b", 0o077)
    assert id_a == id_b
    assert tar_a == tar_b
    manifest = (a / "build" / "demo" / MANIFEST).read_text()
    assert str(tmp_path) not in manifest and str(REPO) not in manifest
    assert "built_at" not in manifest


# ---------------------------------------------------------------- the SDK hand-off closes
STAND_IN = """#!/usr/bin/env bash
# Test fixture only: writes a placeholder where qaic-compile would write the program.
set -e
for a in "$@"; do case "$a" in -aic-binary-dir=*) out="${a#-aic-binary-dir=}";; esac; done
mkdir -p "$out" && printf 'placeholder program for %s' "$out" > "$out/programqpc.bin"
echo "stand-in compiled $out"
"""


@pytest.fixture
def emitted(repo_copy, tmp_path) -> tuple[Path, dict]:
    out = tmp_path / "card"
    build(repo_copy / "recipes" / "demo.yaml", tmp_path / "cache", out,
          "backends=[qaic,onnxruntime]", emit_only=True)
    compiler = tmp_path / "sdk" / "qaic-compile"
    compiler.parent.mkdir()
    compiler.write_text(STAND_IN)
    compiler.chmod(0o755)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return out, {**os.environ, "QAIC_COMPILER": str(compiler), "PATH": path}


def test_emit_compile_sh_finish_closes_the_hand_off(emitted, tmp_path):
    out, env = emitted
    before = runner.invoke(app, ["serve-config", str(out)]).stdout
    assert "not compiled" in before
    assert (out / "target" / "qaic" / "compile.sh").stat().st_mode & 0o100
    if not shutil.which("qpcbuild", path=env["PATH"]):
        pytest.skip("the qpcbuild console script is not installed beside this Python")
    for role in ("target", "draft"):
        done = subprocess.run(["bash", str(out / role / "qaic" / "compile.sh")], env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    assert verify_bundle(out) == []
    m = read_manifest(out).to_json_dict()
    for role in ("target", "draft"):
        q = m["roles"][role]["backends"]["qaic"]
        assert q["status"] == "compiled" and q["qpc_files"] == [f"{role}/qpc/programqpc.bin"]
        assert q["log"] == f"{role}/logs/qaic-compile.log" and q["compiler"]["name"] == \
            "qaic-compile"
        assert f"{role}/qpc/programqpc.bin" in m["files"]
    after = runner.invoke(app, ["serve-config", str(out)])
    assert after.exit_code == 0 and "not compiled" not in after.stdout
    assert str(out.resolve() / "target" / "qpc") in after.stdout
    shown = runner.invoke(app, ["inspect", str(out)]).stdout
    assert "target QPC: target/qpc (1 files" in shown and "draft QPC: draft/qpc" in shown
    # On a machine without qaicrt, run says what is missing, not that nothing was compiled.
    ran = runner.invoke(app, ["run", str(out), "--backend", "qaic", "--prompt", "x"])
    assert ran.exit_code == 1 and "qaicrt" in ran.output and "not compiled" not in ran.output
    # The archive keeps compile.sh runnable.
    runner.invoke(app, ["package", str(out), "-o", str(tmp_path / "card.tar.gz")])
    with tarfile.open(tmp_path / "card.tar.gz") as tar:
        modes = {m.name: m.mode for m in tar.getmembers()}
    assert modes["demo/target/qaic/compile.sh"] == 0o755 and modes["demo/recipe.yaml"] == 0o644
    runner.invoke(app, ["unpack", str(tmp_path / "card.tar.gz"), "-d", str(tmp_path / "u")])
    assert os.access(tmp_path / "u" / "demo" / "target" / "qaic" / "compile.sh", os.X_OK)
    assert verify_bundle(tmp_path / "u" / "demo") == []


def test_finish_by_hand_when_qpcbuild_is_not_on_the_sdk_machines_path(emitted):
    out, env = emitted
    env = {**env, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["bash", str(out / "target" / "qaic" / "compile.sh")], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "qpcbuild finish" in done.stderr
    assert "extra file: target/qpc/programqpc.bin" in verify_bundle(out)
    result = runner.invoke(app, ["finish", str(out), "--role", "target"])
    assert result.exit_code == 0, result.output
    assert verify_bundle(out) == []
    assert read_manifest(out).draft.backends["qaic"].status == "emitted"


def test_finish_refuses_a_missing_or_empty_qpc_naming_the_role(emitted):
    out, _ = emitted
    with pytest.raises(BundleError, match="the target QPC is missing"):
        finish_bundle(out)
    (out / "target" / "qpc").mkdir()
    (out / "target" / "qpc" / "programqpc.bin").write_bytes(b"")
    with pytest.raises(BundleError, match="the target QPC is empty"):
        finish_bundle(out, ["target"])
    result = runner.invoke(app, ["finish", str(out), "--role", "draft"])
    assert result.exit_code == 1 and "the draft QPC is missing" in result.output


def test_finish_refuses_a_bundle_that_was_changed(emitted):
    out, _ = emitted
    (out / "target" / "qpc").mkdir()
    (out / "target" / "qpc" / "programqpc.bin").write_bytes(b"program")
    (out / "target" / "onnx" / "model.onnx").write_bytes(b"swapped graph")
    with pytest.raises(BundleError, match="changed file: target/onnx/model.onnx"):
        finish_bundle(out, ["target"])


# ---------------------------------------------------------------- kills and concurrency
SLOW_COMPILER = """#!/usr/bin/env bash
touch "{started}"
exec sleep 60
"""


def _start_slow_build(root: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    started = tmp_path / "compiler-started"
    compiler = tmp_path / "slow-compiler"
    compiler.write_text(SLOW_COMPILER.format(started=started))
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    proc = subprocess.Popen([*QPCBUILD, "compile", "recipes/demo.yaml", "--set",
                             "backends=[qaic]", "--compiler", str(compiler), "-o", "build/demo"],
                            cwd=root, env={**os.environ, "QPCBUILD_CACHE": str(cache)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not started.exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "the build never reached the compiler"
        time.sleep(0.05)
    assert debris(root / "build" / "demo", cache), "no staging folder while building"
    return proc, root / "build" / "demo", cache


def test_sigterm_removes_the_staging_folder_and_cache_temp_folders(repo_copy, tmp_path):
    root = checkout(tmp_path / "co")
    proc, out, cache = _start_slow_build(root, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert debris(out, cache) == [] and not out.exists()


def test_a_killed_builds_debris_is_removed_by_the_next_build(tmp_path):
    root = checkout(tmp_path / "co")
    proc, out, cache = _start_slow_build(root, tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert debris(out, cache)  # SIGKILL cannot clean up
    build(root / "recipes" / "demo.yaml", cache, out)
    assert debris(out, cache) == [] and verify_bundle(out) == []


def test_concurrent_builds_into_one_output_all_succeed(repo_copy, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    recipe = repo_copy / "recipes" / "demo.yaml"
    errors: list[BaseException] = []
    ids: list[str] = []

    def one():
        try:
            ids.append(build(recipe, cache, out).bundle_id)
        except BaseException as exc:  # collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    procs = [subprocess.Popen([*QPCBUILD, "compile", str(recipe), "-o", str(out), "--json"],
                              env={**os.environ, "QPCBUILD_CACHE": str(cache)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    for t in threads:
        t.join()
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        ids.append(json.loads(stdout)["bundle_id"])
    assert errors == [] and len(set(ids)) == 1 and len(ids) == 15
    assert verify_bundle(out) == [] and debris(out, cache) == []

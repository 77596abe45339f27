"""Every bad input gets a clear error naming the problem and where it is, exit code 2 (bad
input) or 1 (a damaged bundle), and nothing half-written: never a traceback, a hang or a silent
acceptance. Each case here was once seen to fail that way. The fuzz tests at the end assert the
same over generated recipes, configs and safetensors headers (QPCBUILD_FUZZ_EXAMPLES sets how
many; CI runs a few hundred per kind)."""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qpcbuild.models.arch import arch_from_config
from qpcbuild.bundle import archive
from qpcbuild.cli import app
from qpcbuild.errors import QpcbuildError, UsageError
from qpcbuild.models.safetensors import read_header
from qpcbuild.recipe import recipe_from_text

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo" / "target"
FUZZ = int(os.environ.get("QPCBUILD_FUZZ_EXAMPLES", "300"))
runner = CliRunner()


def cli(*argv: str):
    return runner.invoke(app, [str(a) for a in argv])


def recipe_for(folder: Path, model: Path, extra: str = "") -> Path:
    path = folder / "r.yaml"
    path.write_text(f"schema: 1\nname: x\ntarget:\n  model: {model}\n{extra}draft:\n"
                    "  method: ngram\nshapes: {ctx_len: 128}\n")
    return path


@pytest.fixture
def model(tmp_path) -> Path:
    """A writable copy of the demo target."""
    return Path(shutil.copytree(DEMO, tmp_path / "model"))


def edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------- recipe files
def test_recipe_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(tmp_path / "loop2.yaml")
    (tmp_path / "loop2.yaml").symlink_to(loop)
    for path, says in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                       (loop, "symbolic links")):
        done = subprocess.run([sys.executable, "-m", "qpcbuild", "plan", str(path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr, (path, done.stderr)
        assert "Traceback" not in done.stderr


def test_absurd_ctx_len_is_refused_before_anything_is_allocated(tmp_path):
    result = cli("compile", recipe_for(tmp_path, DEMO, ""), "--set", "shapes.ctx_len=1073741824",
                 "-o", tmp_path / "out", "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 2 and "shapes.ctx_len" in result.output
    result = cli("plan", recipe_for(tmp_path, DEMO), "--set", "shapes.ctx_len=4096")
    assert result.exit_code == 2 and "max_position_embeddings (2048)" in result.output


def test_duplicate_keys_are_refused_with_both_lines():
    text = "schema: 1\nname: x\ntarget: {model: m}\nshapes:\n  ctx_len: 512\n  ctx_len: 1024\n"
    with pytest.raises(UsageError, match=r"shapes.ctx_len \(line 6\): duplicate key \(first on "
                                         r"line 5\)"):
        recipe_from_text(text)


def test_schema_and_cross_field_problems_come_in_one_report():
    text = ("schema: 1\nname: x\ntarget: {model: m}\ndraft: {method: ngram}\nshapes:\n"
            "  batch_size: 'a'\n  prefill_seq_len: 2000\n  ctx_len: 1024\nbogus: 1\n")
    with pytest.raises(UsageError) as info:
        recipe_from_text(text)
    paths = {p.path for p in info.value.problems}
    assert paths == {"shapes.batch_size", "shapes.prefill_seq_len", "bogus"}


# ---------------------------------------------------------------- model folders
@pytest.mark.parametrize("changes,says", [
    ({"num_hidden_layers": -3}, "num_hidden_layers: -3 is outside"),
    ({"num_hidden_layers": 0}, "num_hidden_layers: 0 is outside"),
    ({"num_hidden_layers": 1e9}, "num_hidden_layers: expected a positive integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers: expected a positive integer"),
    ({"hidden_size": 256.5}, "hidden_size: expected a positive integer, got 256.5"),
    ({"hidden_size": "256"}, "hidden_size: expected a positive integer, got '256'"),
    ({"hidden_size": None}, "hidden_size: expected a positive integer, got None"),
    ({"rms_norm_eps": -1}, "rms_norm_eps: expected a finite number > 0"),
    ({"rope_parameters": {"rope_theta": "abc"}}, "rope_theta: expected a finite number"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"num_hidden_layers": 3}, "the checkpoint has 6 layers, config.json says "
                               "num_hidden_layers: 3"),
    ({"intermediate_size": 512}, "tensor shapes do not match config.json"),
])
def test_bad_config_is_refused_naming_the_key(model, tmp_path, changes, says):
    edit_config(model, **changes)
    result = cli("compile", recipe_for(tmp_path, model), "-o", tmp_path / "out", "--cache-dir",
                 tmp_path / "cache")
    assert result.exit_code == 2 and says in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_unused_weights_are_exported_only_when_the_recipe_opts_in(model, tmp_path):
    edit_config(model, num_hidden_layers=3)
    recipe = recipe_for(tmp_path, model, "  allow_unused_weights: true\n")
    result = cli("compile", recipe, "-o", tmp_path / "out", "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["roles"]["target"]["arch"]["num_layers"] == 3


def _write_header(path: Path, header: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("damage,says", [
    (lambda m: _write_header(m / "model.safetensors", b"[1, 2]"),
     "corrupt safetensors header (a JSON object of tensors expected, got a list)"),
    (lambda m: ((m / "model.safetensors").unlink(), (m / "model.safetensors").mkdir()),
     "model.safetensors: not a regular file"),
    (lambda m: (m / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}'),
     "weight_map must map tensor names to shard files, got a list"),
    (lambda m: (m / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "/etc/passwd"}}'), "is not a file name inside"),
    (lambda m: (m / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "../model/model.safetensors"}}'), "is not a file name inside"),
    (lambda m: (m / "tokenizer.json").unlink(), "has no tokenizer.json"),
])
def test_bad_weights_folder_is_refused_naming_the_file(model, tmp_path, damage, says):
    damage(model)
    result = cli("compile", recipe_for(tmp_path, model), "-o", tmp_path / "out", "--cache-dir",
                 tmp_path / "cache")
    assert result.exit_code == 2 and says in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_nan_weights_are_refused_naming_the_tensor(model, tmp_path):
    path = model / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8:8 + n])["model.norm.weight"]
    begin, end = meta["data_offsets"]
    raw[8 + n + begin:8 + n + end] = np.full((end - begin) // 2, np.nan, np.float16).tobytes()
    path.write_bytes(bytes(raw))
    result = cli("compile", recipe_for(tmp_path, model), "-o", tmp_path / "out", "--cache-dir",
                 tmp_path / "cache")
    assert result.exit_code == 2 and "'model.norm.weight' holds NaN" in result.output


# ---------------------------------------------------------------- outputs and the cache
def test_unusable_output_or_cache_is_refused_before_building(tmp_path):
    recipe = recipe_for(tmp_path, DEMO)
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me\n")
    for argv, says in ((["-o", a_file], "exists and is not a folder"),
                       (["-o", a_file / "sub" / "out"], "cannot create"),
                       (["-o", tmp_path / "o", "--cache-dir", a_file / "cache"],
                        "is not usable")):
        result = cli("compile", recipe, *argv, *(["--cache-dir", tmp_path / "c"]
                                                 if "--cache-dir" not in argv else []))
        assert result.exit_code == 2 and says in result.output, result.output
        assert "Traceback" not in result.output
    assert a_file.read_text() == "keep me\n" and not (tmp_path / "c" / "exports").exists()


# ---------------------------------------------------------------- archives
def test_archive_bomb_is_refused_and_leaves_nothing(tmp_path):
    bomb = tmp_path / "bomb.tar.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        info = tarfile.TarInfo("b/zeros.bin")
        info.size = 100 << 20
        tar.addfile(_dir("b"))
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    assert bomb.stat().st_size < 1 << 20
    result = cli("unpack", bomb, "-d", tmp_path / "dest")
    assert result.exit_code == 2 and "archive bomb" in result.output
    assert not (tmp_path / "dest").exists()


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


def test_full_disk_while_packing_or_unpacking_is_reported_and_leaves_nothing(tmp_path,
                                                                             monkeypatch):
    bundle = tmp_path / "b"
    (bundle / "x").mkdir(parents=True)
    (bundle / "manifest.json").write_text("{}")
    (bundle / "x" / "data").write_bytes(b"x" * 1000)
    good = archive.pack(bundle, tmp_path / "good.tar.gz")
    old = (tmp_path / "out.tar.gz")
    old.write_bytes(b"previous")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(archive.shutil, "copyfileobj", disk_full)
    with pytest.raises(UsageError, match="No space left on device"):
        archive.unpack(good, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    monkeypatch.setattr(archive, "_write_tar", disk_full)
    with pytest.raises(UsageError, match="No space left on device"):
        archive.pack(bundle, old)
    assert old.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "good.tar.gz", "out.tar.gz"]


# ---------------------------------------------------------------- run arguments and bundles
@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bundle")
    out = root / "demo"
    result = cli("compile", REPO / "recipes" / "demo-ngram.yaml", "-o", out, "--cache-dir",
                 root / "cache")
    assert result.exit_code == 0, result.output
    return out


def test_bad_run_arguments_exit_2_with_a_message(bundle, tmp_path):
    nested = tmp_path / "nested.jsonl"
    nested.write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    for extra, says in ((["--prompt-file", tmp_path], "not a regular file"),
                        (["--prompt-file", nested], "needs a \"prompt\""),
                        (["--prompt", "x", "--seed", "-1"], "seed must be"),
                        (["--prompt", "x", "--temperature", "nan"], "temperature must be"),
                        (["--prompt", "x", "--top-p", "nan"], "top_p must be"),
                        (["--prompt", "x", "--backend", "tensorrt"], "unknown backend")):
        result = cli("run", bundle, *extra)
        assert result.exit_code == 2 and says in result.output, (extra, result.output)


@pytest.mark.parametrize("command", [["verify"], ["inspect"], ["run", "--prompt", "x"],
                                     ["serve-config"], ["finish"], ["package", "-o", "x.tgz"]])
def test_a_bundle_path_that_is_not_a_bundle_exits_2(tmp_path, command):
    for path in (tmp_path / "missing", tmp_path):
        result = cli(command[0], path, *command[1:])
        assert result.exit_code == 2, (command, path, result.output)


def test_a_bundle_too_large_for_this_machine_is_refused_before_allocating(bundle, monkeypatch):
    from qpcbuild.runtime import loader

    monkeypatch.setattr(loader, "available_memory", lambda: 1 << 20)
    result = cli("run", bundle, "--prompt", "x")
    assert result.exit_code == 1 and "needs about" in result.output
    assert "only 0.0 GiB is available" in result.output


@pytest.mark.parametrize("change,says", [
    (lambda m: m.update(files=list(m["files"])), "manifest field files is missing or not a "
                                                 "JSON object"),
    (lambda m: m["files"]["recipe.yaml"].pop("sha256"), "files.recipe.yaml: expected"),
    (lambda m: m["roles"]["target"].pop("backends"), "roles.target.backends is missing"),
])
def test_malformed_manifest_is_a_bundle_failure_naming_the_field(bundle, tmp_path, change, says):
    copy = Path(shutil.copytree(bundle, tmp_path / "copy"))
    m = json.loads((copy / "manifest.json").read_text())
    change(m)
    (copy / "manifest.json").write_text(json.dumps(m))
    for command in (["verify"], ["run", "--prompt", "x"], ["inspect"]):
        result = cli(command[0], copy, *command[1:])
        assert result.exit_code == 1 and says in result.output, (command, result.output)


@pytest.mark.parametrize("argv", [["plan", "RECIPE", "--json"], ["compile", "RECIPE", "--json"],
                                  ["verify", "MISSING", "--json"], ["inspect", "MISSING", "--json"],
                                  ["run", "MISSING", "--prompt", "x", "--json"]])
def test_json_commands_print_a_json_error_on_failure(tmp_path, argv):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: 1\nname: x\ntarget: {model: m}\ndraft: {method: ngram}\n"
                   "shapes: {ctx_len: 100}\n")
    argv = [str(bad) if a == "RECIPE" else str(tmp_path / "nope") if a == "MISSING" else a
            for a in argv]
    result = runner.invoke(app, argv)
    error = json.loads(result.stdout)["error"]
    assert result.exit_code == error["code"] == 2 and error["message"]
    if argv[0] in ("plan", "compile"):
        assert [w["path"] for w in error["where"]] == ["shapes.ctx_len"]


# ---------------------------------------------------------------- fuzz
RECIPE_KEYS = {
    "schema": st.sampled_from([1, 2, "1", None]),
    "name": st.one_of(st.text(max_size=12), st.integers()),
    "target": st.fixed_dictionaries({"model": st.sampled_from(["m", "", None, 5])}),
    "draft": st.fixed_dictionaries({"method": st.sampled_from(["ngram", "suffix", "draft_model",
                                                               "eagle", 3])}),
    "speculation": st.fixed_dictionaries({"num_speculative_tokens": st.one_of(
        st.integers(-3, 40), st.lists(st.integers(-1, 40), max_size=4), st.text(max_size=3))}),
    "shapes": st.dictionaries(st.sampled_from(["batch_size", "full_batch_size", "ctx_len",
                                               "prefill_seq_len", "ctx"]),
                              st.one_of(st.integers(-5, 1 << 31), st.floats(), st.none(),
                                        st.booleans(), st.text(max_size=3)), max_size=4),
    "hardware": st.dictionaries(st.sampled_from(["card", "num_cards", "target", "draft"]),
                                st.one_of(st.integers(-2, 20), st.text(max_size=8),
                                          st.fixed_dictionaries({"device_group": st.lists(
                                              st.integers(-1, 8), max_size=5),
                                              "num_cores": st.integers(-1, 20)})),
                                max_size=3),
    "backends": st.lists(st.sampled_from(["onnxruntime", "qaic", "tensorrt"]), max_size=3),
    "precision": st.dictionaries(st.sampled_from(["quantization", "kv_cache_dtype"]),
                                 st.sampled_from(["none", "mxfp6", "mxint8", "float16", 1]),
                                 max_size=2),
}


def _yaml_text(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({}, optional=RECIPE_KEYS), st.text(max_size=40))
def test_fuzz_recipes_give_a_recipe_or_a_usage_error(data, junk):
    for text in (_yaml_text(data), _yaml_text(data) + junk, junk):
        try:
            recipe_from_text(text)
        except UsageError:
            pass


BASE_CONFIG = json.loads((DEMO / "config.json").read_text())
CONFIG_VALUES = st.one_of(st.integers(-10, 1 << 40), st.floats(allow_nan=True), st.none(),
                          st.booleans(), st.text(max_size=5), st.lists(st.integers(0, 9),
                                                                       max_size=3),
                          st.dictionaries(st.sampled_from(["rope_theta", "rope_type", "factor"]),
                                          st.one_of(st.floats(), st.text(max_size=6)),
                                          max_size=3))


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(sorted(BASE_CONFIG) + ["rope_scaling", "head_dim",
                                                               "sliding_window"]),
                       CONFIG_VALUES, max_size=6))
def test_fuzz_configs_give_an_architecture_or_a_usage_error(changes):
    try:
        arch = arch_from_config({**BASE_CONFIG, **changes})
    except UsageError:
        return
    assert arch.num_layers >= 1 and arch.head_dim >= 1 and arch.rms_norm_eps > 0
    arch.inv_freq()  # and what was accepted can be used


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.binary(max_size=64), st.recursive(
    st.one_of(st.integers(-5, 1 << 40), st.text(max_size=4), st.none(), st.floats()),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=12).map(lambda v: json.dumps({"w": v} if not isinstance(v, dict) else v)
                       .encode())), st.integers(0, 64))
def test_fuzz_safetensors_headers_give_tensors_or_a_usage_error(tmp_path_factory, header, pad):
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(pad))
    try:
        read_header(path)
    except UsageError:
        pass
    except QpcbuildError as exc:  # pragma: no cover - would be a wrong exit code
        raise AssertionError(f"not a usage error: {exc!r}") from exc

"""The runtime re-checks what it loads. The seal is an unkeyed digest: anyone who can write a
bundle can edit its manifest and seal it again. Such a bundle must fail with a clear error naming
what is wrong (exit 1 or 2), never a traceback or a hang; a corrupt tokenizer is an error, not
an absent one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import qpcbuild
from qpcbuild.bundle.manifest import MANIFEST, leaves, read_manifest, seal
from qpcbuild.cli import app
from qpcbuild.errors import QpcbuildError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def pristine(demo_build) -> Path:
    return demo_build[0]


def resealed(pristine: Path, tmp: Path, edit) -> Path:
    out = tmp / "edited"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(pristine, out)
    m = json.loads((out / MANIFEST).read_text())
    edit(m)
    (out / MANIFEST).write_text(json.dumps(seal(m)))  # a valid seal over the edited content
    return out


def swap_artifacts(m):
    t, d = m["roles"]["target"], m["roles"]["draft"]
    ta, da = t["backends"]["onnxruntime"]["artifact"], d["backends"]["onnxruntime"]["artifact"]
    for role, path in ((t, da), (d, ta)):
        role["backends"]["onnxruntime"]["artifact"] = path


def everywhere_ctx_len(n):
    def edit(m):
        m["shapes"]["ctx_len"] = n
        for role in m["roles"].values():
            role["backends"]["onnxruntime"]["fixed_dims"]["ctx_len"] = n
            for spec in role["specializations"]:
                spec["symbols"]["ctx_len"] = str(n)
    return edit


def setter(*path_and_value):
    *path, value = path_and_value

    def edit(m):
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


EDITS = {
    "swapped artifacts": (swap_artifacts, "graph does not match"),
    "ctx_len 1024 everywhere": (everywhere_ctx_len(1024), "graph does not match"),
    "ctx_len 1024 in shapes only": (setter("shapes", "ctx_len", 1024), "ctx_len"),
    "batch_size 0": (setter("shapes", "batch_size", 0), "shapes.batch_size"),
    "ctx_len as a string": (setter("shapes", "ctx_len", "512"), "shapes.ctx_len"),
    "num_layers 3": (setter("roles", "target", "arch", "num_layers", 3), "num_layers"),
    "num_speculative_tokens []": (setter("speculation", "num_speculative_tokens", []),
                                  "speculation.num_speculative_tokens"),
    "draft role removed": (lambda m: m["roles"].pop("draft"), "draft"),
    "intra_op_threads 1000000": (setter("roles", "target", "ort", "intra_op_threads", 1000000),
                                 "intra_op_threads"),
    "vocab_size 100": (setter("roles", "target", "arch", "vocab_size", 100), "vocab"),
    "a K never compiled": (setter("speculation", "num_speculative_tokens", [0, 9]), "K=9"),
    "head_dim 64": (setter("roles", "draft", "arch", "head_dim", 64), "graph does not match"),
    "unknown method": (setter("speculation", "method", "oracle"), "speculation.method"),
    "specializations []": (setter("roles", "draft", "specializations", []), "specializations"),
    # the adaptive fields (docs/adaptive.md) and the per-role ORT weight formats
    "unknown policy": (setter("speculation", "policy", "sometimes"), "speculation.policy"),
    "draft_p_min 2": (setter("speculation", "draft_p_min", 2.0), "speculation.draft_p_min"),
    "schedule to a K never compiled": (
        setter("speculation", "num_speculative_tokens_per_batch_size", {"1": 9}),
        "num_speculative_tokens_per_batch_size 1: K=9"),
    "schedule batch size 0": (setter("speculation", "num_speculative_tokens_per_batch_size",
                                     {"0": 4}), "num_speculative_tokens_per_batch_size"),
    # bundles built before the one name recorded the schedule as k_schedule: read, checked
    "k_schedule (older bundles) to a K never compiled": (
        setter("speculation", "k_schedule", {"1": 9}),
        "num_speculative_tokens_per_batch_size 1: K=9"),
    "weights int3": (setter("roles", "draft", "backends", "onnxruntime", "weights", "int3"),
                     "roles.draft.backends.onnxruntime.weights"),
}


@pytest.mark.parametrize("name", EDITS)
def test_a_resealed_edit_is_a_clear_error_not_a_traceback(pristine, tmp_path, name):
    edit, says = EDITS[name]
    bundle = resealed(pristine, tmp_path, edit)
    result = runner.invoke(app, ["run", str(bundle), "--prompt", "def f", "--max-new-tokens", "2"])
    assert result.exit_code in (1, 2), result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert says in result.output, result.output


def test_the_pristine_bundle_still_runs(pristine):
    result = runner.invoke(app, ["run", str(pristine), "--prompt", "def f", "--max-new-tokens",
                                 "2"])
    assert result.exit_code == 0, result.output


def test_a_bundle_with_every_adaptive_field_and_quantized_weights_loads(tmp_path):
    """What main's builds write (speculation.policy, draft_p_min, the K per batch size, int8/int4 ORT
    weights) passes the typed manifest and runs."""
    recipe = ROOT / "recipes" / "demo.yaml"
    out = tmp_path / "bundle"
    sets = ["speculation.policy=auto", "speculation.draft_p_min=0.3",
            "speculation.num_speculative_tokens_per_batch_size={1: 4}",
            "onnxruntime.target_weights=int8", "onnxruntime.draft_weights=int4"]
    result = runner.invoke(app, ["compile", str(recipe), "-o", str(out), "--cache-dir",
                                 str(tmp_path / "cache")] + [a for s in sets for a in ("--set", s)])
    assert result.exit_code == 0, result.output
    spd = read_manifest(out).speculation
    assert (spd.policy, spd.draft_p_min, spd.num_speculative_tokens_per_batch_size) == \
        ("auto", 0.3, {"1": 4})
    result = runner.invoke(app, ["run", str(out), "--prompt", "def f", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- fuzz over manifest edits
def editable_leaves(m) -> list[str]:
    return [p for p, _ in leaves({k: v for k, v in m.items() if k not in ("files", "seal",
                                                                         "bundle_id")})]


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=2), max_leaves=4)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_manifest_edits_load_or_fail_cleanly(pristine, tmp_path_factory, data):
    m = json.loads((pristine / MANIFEST).read_text())
    paths = editable_leaves(m)
    path = data.draw(st.sampled_from(paths), label="field")
    value = data.draw(st.one_of(_json, st.integers(-3, 5000)), label="value")
    tmp = tmp_path_factory.mktemp("fuzz")

    def edit(man):
        node, keys = man, path.split(".")
        for key in keys[:-1]:
            node = node[key]
        if isinstance(node, dict):
            node[keys[-1]] = value

    try:
        bundle = resealed(pristine, tmp, edit)
        gen = qpcbuild.load(bundle, verify="full")
        gen.generate(["def f"], max_new_tokens=2)
    except QpcbuildError:
        pass  # refused when sealing or when loading: fine
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # 60 copies of the bundle otherwise


# ---------------------------------------------------------------- corrupt tokenizers
@pytest.mark.parametrize("content", ["{not json", '{"model": {"vocab": {"a": "1"}}}',
                                     '{"model": {"vocab": {"a": NaN}}}', "[1, 2]"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_corrupt_tokenizer_is_an_error_not_absent(tmp_path, role, content):
    models = tmp_path / "models"
    shutil.copytree(DEMO / "target", models / "target")
    shutil.copytree(DEMO / "draft", models / "draft")
    (models / role / "tokenizer.json").write_text(content)
    result = runner.invoke(app, ["compile", str(ROOT / "recipes" / "demo.yaml"), "-o",
                                 str(tmp_path / "bundle"), "--cache-dir", str(tmp_path / "cache"),
                                 "--set", f"target.model={models / 'target'}",
                                 "--set", f"draft.model={models / 'draft'}"])
    assert result.exit_code == 2, result.output
    assert f"{role}.model" in result.output and "tokenizer.json" in result.output
    assert not (tmp_path / "bundle").exists()


# ---------------------------------------------------------------- bench and tune verify fully
def flipped(pristine: Path, tmp: Path) -> Path:
    """A copy with one byte of the target's weights changed, size unchanged."""
    out = tmp / "flipped"
    shutil.copytree(pristine, out)
    data = next(p for p in (out / "target" / "ort").iterdir() if p.suffix == ".data")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    return out


def test_bench_refuses_a_same_size_flipped_byte(pristine, tmp_path):
    bundle = flipped(pristine, tmp_path)
    result = runner.invoke(app, ["bench", str(bundle), "--peers", "none", "--max-new-tokens",
                                 "2", "--repeats", "1", "--num-prompts", "1", "--json-out",
                                 str(tmp_path / "r.json"), "--no-plot"])
    assert result.exit_code == 1 and "does not match" in result.output, result.output


def test_tune_calibration_refuses_a_same_size_flipped_byte(pristine, tmp_path):
    from qpcbuild.errors import BundleError
    from qpcbuild.tune.calibrate import calibrate

    bundle = flipped(pristine, tmp_path)
    with pytest.raises(BundleError, match="does not match"):
        calibrate(bundle, "draft_model", 4, ["def f"], 2, costs=None, batches=[1])


# ---------------------------------------------------------------- the schema and its one copy
def test_an_older_schema_is_refused_naming_its_version(pristine, tmp_path):
    """Schema 2 stored K and the shapes several times; this qpcbuild reads schema 3 only, and
    says so (bad input for this version, exit 2) instead of failing on a missing field."""
    out = tmp_path / "old"
    shutil.copytree(pristine, out)
    m = json.loads((out / MANIFEST).read_text())
    m["schema"] = 2
    for role in m["roles"].values():
        role["compiled_ks"] = m["speculation"]["num_speculative_tokens"]
    (out / MANIFEST).write_text(json.dumps(seal(m)))
    for argv in (["run", str(out), "--prompt", "def f", "--max-new-tokens", "2"],
                 ["inspect", str(out)], ["verify", str(out)]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2, (argv, result.output)
        assert "manifest schema 2" in result.output and "rebuild" in result.output, result.output


def test_the_model_writes_back_exactly_the_json_it_read(pristine):
    """The typed Manifest is the bundle's contract: reading it and writing it back changes no
    byte of content, so the bundle id is the one the file carries."""
    raw = json.loads((pristine / MANIFEST).read_text())
    m = read_manifest(pristine)
    assert m.to_json_dict() == raw
    assert seal(m.to_json_dict())["bundle_id"] == raw["bundle_id"] == m.bundle_id
    # K and the shapes are recorded once: no role carries its own copy
    assert all("compiled_ks" not in role and set(role["ort"]) == {"core_share",
                                                                 "intra_op_threads"}
               for role in raw["roles"].values())
    assert m.ks == tuple(raw["speculation"]["num_speculative_tokens"])

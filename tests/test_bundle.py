"""End-to-end bundle builds with the onnxruntime backend, on tiny random Llama models.

Every test builds into its own cache (tmp_path), never the user cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import onnx
import pytest
import yaml
from typer.testing import CliRunner

import qpcbuild.bundle.build as bundle_mod
import qpcbuild.export.model as export_mod  # where bundle/build.py finds export_model
from qpcbuild.bundle import BuildResult, build_bundle, read_manifest, verify_bundle
from qpcbuild.cache import Cache
from qpcbuild.cli import app
from qpcbuild.backends.onnxruntime.build import OrtBackend
from qpcbuild.backends.onnxruntime.weights import PortableWeights
from qpcbuild.errors import BundleError, QpcbuildError, ToolchainError, UsageError
from qpcbuild.export import DATA_FILE, GRAPH_FILE
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe
from qpcbuild.tree import free_range

pytestmark = pytest.mark.slow

runner = CliRunner()

# Every file an onnxruntime-only bundle of the fixture pair holds, besides manifest.json.
ORT_FILES = [
    "draft/ort/model.onnx",
    "draft/ort/model.onnx.data",
    "recipe.yaml",
    "target/ort/model.onnx",
    "target/ort/model.onnx.data",
    "tokenizer/generation_config.json",
    "tokenizer/tokenizer.json",
]


# ---------------------------------------------------------------- fixture models and recipes
def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, 256)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _save_llama(folder: Path, hidden: int, layers: int, seed: int, tokenizer) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    gen = folder / "generation_config.json"
    if not gen.is_file():  # written by save_pretrained today; keep the file list fixed anyway
        gen.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    return folder


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tok = _tokenizer()
    return {
        "target": _save_llama(root / "target", 64, 2, seed=0, tokenizer=tok),
        "draft": _save_llama(root / "draft", 32, 1, seed=1, tokenizer=tok),
        "draft_b": _save_llama(root / "draft_b", 32, 1, seed=2, tokenizer=tok),
    }


def recipe_text(models: dict[str, Path], name: str = "tiny", k: int = 3,
                draft: str = "draft") -> str:
    return f"""\
schema: 1
name: {name}
target:
  model: {models["target"]}
draft:
  method: draft_model
  model: {models[draft]}
speculation:
  num_speculative_tokens: {k}
shapes:
  batch_size: 1
  prefill_seq_len: 8
  ctx_len: 64
hardware:
  card: cloud-ai-100-ultra
  target: {{device_group: [0], num_cores: 10}}
  draft: {{device_group: [0], num_cores: 6}}
backends: [onnxruntime]
"""


@pytest.fixture
def recipe(models, tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(recipe_text(models))
    return path


def build(recipe: Path, cache: Path, out: Path, *overrides: str, **kw) -> BuildResult:
    plan = make_plan(load_recipe(recipe, list(overrides)))
    return build_bundle(plan, cache=Cache(cache), out=out, **kw)


def reuse(result: BuildResult) -> dict[str, bool]:
    return {s["stage"]: s["reused"] for s in result.stages}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_on_disk(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def leftovers(out: Path) -> list[str]:
    """Staging or half-replaced folders that a build must never leave beside its output."""
    return sorted(p.name for p in out.parent.iterdir()
                  if p.name.startswith((f".{out.name}.building-", f".{out.name}.old-")))


def cache_temp_dirs(cache: Path) -> list[Path]:
    return [p for kind in ("exports", "ort", "qpc") if (cache / kind).is_dir()
            for p in (cache / kind).iterdir() if p.name.startswith(".")]


def writable(path: Path) -> Path:
    path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return path


def flip_byte(path: Path) -> None:
    writable(path)
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def bundle(recipe, tmp_path) -> Path:
    """A fresh bundle with a private cache: tests may edit its files (after chmod)."""
    out = tmp_path / "out" / "tiny"
    build(recipe, tmp_path / "cache", out)
    return out


# ---------------------------------------------------------------- layout and manifest
def test_compile_writes_bundle_with_complete_manifest(recipe, models, tmp_path):
    out = tmp_path / "out" / "tiny"
    result = build(recipe, tmp_path / "cache", out)

    assert result.bundle == out
    assert files_on_disk(out) == sorted(ORT_FILES + ["manifest.json"])
    assert (out / "tokenizer").is_dir()
    m = read_manifest(out).to_json_dict()
    assert m["schema"] == 3
    assert m["name"] == "tiny"
    assert m["bundle_id"] == result.bundle_id and len(m["bundle_id"]) == 64
    assert m["backends"] == ["onnxruntime"]
    assert m["speculation"]["method"] == "draft_model"
    assert m["speculation"]["num_speculative_tokens"] == [3]

    # Every file, with its size and digest; nothing unlisted.
    assert sorted(m["files"]) == ORT_FILES
    for rel, meta in m["files"].items():
        assert meta == {"size": (out / rel).stat().st_size, "sha256": sha256(out / rel)}, rel

    expect = {"target": (64, 2, 10), "draft": (32, 1, 6)}
    for role, (hidden, layers, cores) in expect.items():
        info = m["roles"][role]
        src = info["source"]
        assert src["ref"] == str(models[role]) and src["origin"] == "local"
        assert "path" not in src  # the recipe's own reference only: nothing host-specific
        assert len(src["weights_digest"]) == 64 and len(src["config_digest"]) == 64
        assert info["arch"]["architecture"] == "LlamaForCausalLM"
        assert (info["arch"]["hidden_size"], info["arch"]["num_layers"]) == (hidden, layers)
        assert "compiled_ks" not in info  # K is recorded once: speculation.num_speculative_tokens
        assert info["num_cores"] == cores
        assert info["device_group"] == [0]
        assert info["backends"]["onnxruntime"]["status"] == "compiled"
        assert info["backends"]["onnxruntime"]["artifact"] == f"{role}/ort/model.onnx"
        for spec in info["specializations"]:
            assert all(isinstance(v, str) for v in spec["symbols"].values())

        # The manifest's io signature is the graph's, and ORT can load the artifact.
        graph = onnx.load(str(out / role / "ort" / "model.onnx"), load_external_data=False)
        assert [i["name"] for i in info["io"]["inputs"]] == [i.name for i in graph.graph.input]
        assert [o["name"] for o in info["io"]["outputs"]] == [o.name for o in graph.graph.output]
        kv = {f"past_{kind}.{i}" for i in range(layers) for kind in ("key", "value")}
        assert kv <= {i["name"] for i in info["io"]["inputs"]}
        assert {f"{n}_RetainedState" for n in kv} <= {o["name"] for o in info["io"]["outputs"]}
        import onnxruntime as ort
        session = ort.InferenceSession(str(out / role / "ort" / "model.onnx"),
                                       providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == [i.name for i in graph.graph.input]

    target_specs = m["roles"]["target"]["specializations"]
    assert [s["name"] for s in target_specs] == ["Prefill", "Decode"]
    assert target_specs[0]["symbols"] == {"batch_size": "1", "seq_len": "8", "ctx_len": "64",
                                          "num_logits_to_keep": "1"}
    assert target_specs[1]["symbols"] == {"batch_size": "1", "seq_len": "4", "ctx_len": "64",
                                          "num_logits_to_keep": "4"}

    tok_digest = sha256(models["target"] / "tokenizer.json")
    assert m["tokenizer"]["verdict"] == "identical"
    assert m["tokenizer"]["target_digest"] == m["tokenizer"]["draft_digest"] == tok_digest
    assert sha256(out / "tokenizer" / "tokenizer.json") == tok_digest

    tc = m["toolchain"]
    for key in ("qpcbuild", "onnx", "onnxruntime", "numpy"):
        assert tc[key], key
    assert tc["backends"]["onnxruntime"]["onnxruntime"] == tc["onnxruntime"]
    # Nothing that differs between two machines building the same thing.
    assert not {"built_at", "commands"} & set(m) and "python" not in tc

    assert yaml.safe_load((out / "recipe.yaml").read_text())["name"] == "tiny"


# ---------------------------------------------------------------- verify
def test_verify_fresh_bundle_is_clean(bundle):
    assert verify_bundle(bundle) == []
    assert verify_bundle(bundle, fast=True) == []


@pytest.mark.parametrize("rel", ORT_FILES)
def test_verify_reports_each_flipped_byte(bundle, rel):
    assert rel in read_manifest(bundle).file_list()
    flip_byte(bundle / rel)
    problems = verify_bundle(bundle)
    assert problems == [f"changed file: {rel} (sha256 differs from the manifest)"]
    # --fast compares sizes only; a same-size change is what it documents it cannot see.
    assert verify_bundle(bundle, fast=True) == []


def test_verify_reports_missing_and_extra_files(bundle):
    (bundle / "target/ort/model.onnx.data").unlink()
    (bundle / "draft/ort/notes.txt").write_text("not from the build\n")
    assert verify_bundle(bundle) == ["missing file: target/ort/model.onnx.data",
                                     "extra file: draft/ort/notes.txt"]
    assert verify_bundle(bundle, fast=True) == verify_bundle(bundle)


def test_verify_fast_catches_size_change(bundle):
    with open(writable(bundle / "draft/ort/model.onnx.data"), "ab") as fh:
        fh.write(b"\0")
    (problem,) = verify_bundle(bundle, fast=True)
    assert problem.startswith("changed file: draft/ort/model.onnx.data (size ")
    result = runner.invoke(app, ["verify", str(bundle), "--fast"])
    assert result.exit_code == 1
    assert "draft/ort/model.onnx.data" in result.stderr


def test_verify_catches_edited_manifest_digest(bundle):
    manifest_path = writable(bundle / "manifest.json")
    m = json.loads(manifest_path.read_text())
    m["files"]["recipe.yaml"]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(m))
    problems = verify_bundle(bundle)
    assert "changed file: recipe.yaml (sha256 differs from the manifest)" in problems
    assert "manifest field changed: files.recipe.yaml" in problems


def test_verify_refuses_corrupt_or_missing_manifest(bundle, tmp_path):
    manifest_path = writable(bundle / "manifest.json")
    manifest_path.write_text('{"schema": 1, "files": ')
    with pytest.raises(BundleError, match="corrupted manifest"):
        verify_bundle(bundle)
    manifest_path.unlink()
    with pytest.raises(UsageError, match="no manifest.json"):
        verify_bundle(bundle)
    result = runner.invoke(app, ["verify", str(bundle)])
    assert result.exit_code == 2 and "manifest.json" in result.stderr  # not a bundle: bad input


def test_cli_verify(bundle):
    ok = runner.invoke(app, ["verify", str(bundle)])
    assert ok.exit_code == 0, ok.output
    flip_byte(bundle / "target/ort/model.onnx")
    bad = runner.invoke(app, ["verify", str(bundle)])
    assert bad.exit_code == 1
    assert "target/ort/model.onnx" in bad.stderr
    assert "draft/" not in bad.stderr


# ---------------------------------------------------------------- reproducibility and cache
def test_same_recipe_gives_same_bundle_id_with_fresh_caches(recipe, tmp_path):
    a = build(recipe, tmp_path / "cache-a", tmp_path / "a" / "tiny")
    b = build(recipe, tmp_path / "cache-b", tmp_path / "b" / "tiny")
    assert a.bundle_id == b.bundle_id
    assert not any(reuse(b).values())
    assert read_manifest(a.bundle).file_list() == read_manifest(b.bundle).file_list()
    # Rebuilding over an existing bundle (cache warm) gives the same id again.
    c = build(recipe, tmp_path / "cache-a", tmp_path / "a" / "tiny")
    assert c.bundle_id == a.bundle_id and all(reuse(c).values())
    assert verify_bundle(c.bundle) == []


def test_second_build_reuses_every_stage(recipe, tmp_path):
    cache = tmp_path / "cache"
    first = build(recipe, cache, tmp_path / "one" / "tiny")
    second = build(recipe, cache, tmp_path / "two" / "tiny")
    stages = ["export target", "export draft", "onnxruntime target", "onnxruntime draft"]
    assert sorted(reuse(first)) == sorted(stages) and not any(reuse(first).values())
    assert reuse(second) == {s: True for s in stages}
    assert second.bundle_id == first.bundle_id
    assert verify_bundle(second.bundle) == []


@pytest.mark.parametrize("override", ["speculation.num_speculative_tokens=2",
                                      "hardware.target.num_cores=8"])
def test_changing_k_or_cores_reuses_both_exports(recipe, tmp_path, override):
    cache = tmp_path / "cache"
    first = build(recipe, cache, tmp_path / "one" / "tiny")
    changed = build(recipe, cache, tmp_path / "two" / "tiny", override)
    r = reuse(changed)
    assert r["export target"] and r["export draft"]
    # Neither K nor the core share changes an onnxruntime artifact (one graph serves every
    # seq_len; threads are chosen at load), so it is reused too; the manifest still differs.
    assert r["onnxruntime target"] and r["onnxruntime draft"]
    assert changed.bundle_id != first.bundle_id
    assert verify_bundle(changed.bundle) == []
    m = read_manifest(changed.bundle).to_json_dict()
    if "num_speculative_tokens" in override:
        assert m["speculation"]["num_speculative_tokens"] == [2]
        assert r["onnxruntime draft"]  # the draft's artifact does not depend on K
    else:
        assert m["roles"]["target"]["num_cores"] == 8


def test_changing_draft_reuses_target_export(recipe, models, tmp_path):
    cache = tmp_path / "cache"
    first = build(recipe, cache, tmp_path / "one" / "tiny")
    other = build(recipe, cache, tmp_path / "two" / "tiny", f"draft.model={models['draft_b']}")
    r = reuse(other)
    assert r["export target"] and r["onnxruntime target"]
    assert not r["export draft"] and not r["onnxruntime draft"]
    m1, m2 = read_manifest(first.bundle).to_json_dict(), read_manifest(other.bundle).to_json_dict()
    assert m1["roles"]["target"]["source"] == m2["roles"]["target"]["source"]
    assert m1["roles"]["draft"]["source"]["weights_digest"] != \
        m2["roles"]["draft"]["source"]["weights_digest"]


def test_different_weights_with_same_mtime_are_not_reused(recipe, models, tmp_path):
    clone = tmp_path / "draft_clone"
    shutil.copytree(models["draft_b"], clone)
    for f in clone.iterdir():
        st = (models["draft"] / f.name).stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    cache = tmp_path / "cache"
    build(recipe, cache, tmp_path / "one" / "tiny")
    other = build(recipe, cache, tmp_path / "two" / "tiny", f"draft.model={clone}")
    assert not reuse(other)["export draft"]


def test_weights_replaced_in_place_with_restored_mtime_are_not_reused(models, recipe, tmp_path):
    """Same folder, same sizes, mtimes restored (as tar or rsync -t do): still a new export."""
    folder = tmp_path / "draft_in_place"
    shutil.copytree(models["draft"], folder)
    cache = tmp_path / "cache"
    first = build(recipe, cache, tmp_path / "one" / "tiny", f"draft.model={folder}")
    for f in folder.iterdir():
        st = f.stat()
        shutil.copyfile(models["draft_b"] / f.name, f)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = build(recipe, cache, tmp_path / "two" / "tiny", f"draft.model={folder}")
    assert not reuse(second)["export draft"]
    assert read_manifest(first.bundle).draft.source.weights_digest != \
        read_manifest(second.bundle).draft.source.weights_digest


# ---------------------------------------------------------------- atomic builds
def _fail_ort(self, ctx, role, onnx_dir):
    raise ToolchainError("injected: onnxruntime failed")


def _interrupting_export(real):
    def export(src, role, *args, **kwargs):
        if role == "draft":
            raise KeyboardInterrupt
        return real(src, role, *args, **kwargs)
    return export


def _interrupting_hash(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["ort-error", "interrupt-in-draft-export",
                                   "interrupt-before-manifest"])
def test_failed_build_leaves_nothing_and_keeps_old_bundle(recipe, tmp_path, monkeypatch, where):
    out = tmp_path / "out" / "tiny"
    # The older bundle comes from another cache, so the failing build starts cold.
    build(recipe, tmp_path / "old-cache", out, "speculation.num_speculative_tokens=2")
    before = {rel: sha256(out / rel) for rel in files_on_disk(out)}
    old_id = read_manifest(out).bundle_id

    if where == "ort-error":
        monkeypatch.setattr(OrtBackend, "build", _fail_ort)
        expected, exc = {"export target": True, "export draft": True}, ToolchainError
    elif where == "interrupt-in-draft-export":
        monkeypatch.setattr(export_mod, "export_model",
                            _interrupting_export(export_mod.export_model))
        expected, exc = {"export target": True, "export draft": False}, KeyboardInterrupt
    else:
        monkeypatch.setattr(bundle_mod, "hash_tree", _interrupting_hash)
        expected = {"export target": True, "export draft": True, "onnxruntime target": True,
                    "onnxruntime draft": True}
        exc = KeyboardInterrupt

    cache = tmp_path / "cache"
    with pytest.raises(exc):
        build(recipe, cache, out, jobs=1)
    monkeypatch.undo()  # verify_bundle hashes with the same hash_tree
    assert leftovers(out) == []
    assert cache_temp_dirs(cache) == []
    assert {rel: sha256(out / rel) for rel in files_on_disk(out)} == before
    assert read_manifest(out).bundle_id == old_id and verify_bundle(out) == []

    again = build(recipe, cache, out, jobs=1)
    assert {k: v for k, v in reuse(again).items() if k in expected} == expected
    assert read_manifest(out).ks == (3,)
    assert verify_bundle(out) == [] and leftovers(out) == []


@pytest.mark.parametrize("where", ["ort-error", "interrupt-before-manifest"])
def test_failed_build_without_a_cache_leaves_nothing_and_keeps_old_bundle(recipe, tmp_path,
                                                                         monkeypatch, where):
    out = tmp_path / "out" / "tiny"
    build(recipe, tmp_path / "old-cache", out, "speculation.num_speculative_tokens=2")
    before = {rel: sha256(out / rel) for rel in files_on_disk(out)}
    if where == "ort-error":
        monkeypatch.setattr(OrtBackend, "build", _fail_ort)
    else:
        monkeypatch.setattr(bundle_mod, "hash_tree", _interrupting_hash)
    with pytest.raises((ToolchainError, KeyboardInterrupt)):
        build_bundle(make_plan(load_recipe(recipe)), cache=None, out=out, jobs=1)
    monkeypatch.undo()
    assert leftovers(out) == []  # the scratch folder lived inside the staging folder
    assert {rel: sha256(out / rel) for rel in files_on_disk(out)} == before
    assert verify_bundle(out) == []


def test_a_build_without_a_cache_frees_each_export_before_the_next_starts(recipe, tmp_path):
    """--no-cache's disk peak: the smaller model (the draft) goes first, and its export is gone
    (its artifact built and moved into the bundle) by the time the target's export has been
    made, even with jobs=2; the bundle is the cached build's."""
    out = tmp_path / "out" / "tiny"
    exports_on_disk: dict[str, list[str]] = {}

    def progress(stage: str, how: str, seconds: float) -> None:  # called as each stage ends
        exports_on_disk[stage] = [p.name for p in out.parent.glob("*/.scratch/exports/*")]

    result = build_bundle(make_plan(load_recipe(recipe)), cache=None, out=out, jobs=2,
                          progress=progress)
    assert [s["stage"] for s in result.stages] == [
        "export draft", "onnxruntime draft", "export target", "onnxruntime target"]
    assert len(exports_on_disk["export target"]) == 1
    assert len(exports_on_disk["export draft"]) == 1
    assert exports_on_disk["export draft"] != exports_on_disk["export target"]
    cached = build(recipe, tmp_path / "cache", tmp_path / "cached" / "tiny")
    assert result.bundle_id == cached.bundle_id and verify_bundle(out) == []
    assert leftovers(out) == []


def _punches_holes(folder: Path) -> bool:
    """Whether this filesystem gives a file's freed ranges back (ext4, XFS, btrfs, tmpfs)."""
    probe = folder / "probe"
    probe.write_bytes(b"x" * 65536)
    with open(probe, "r+b") as fh:
        os.fsync(fh.fileno())
        freed = free_range(fh.fileno(), 0, 65536)
    return freed and probe.stat().st_blocks * 512 < 65536


@pytest.mark.parametrize("release", ["kept", "broken"])
def test_a_build_without_a_cache_frees_each_layer_of_the_export_once_lowered(
        recipe, tmp_path, monkeypatch, release):
    """--no-cache's disk peak inside one role: the fused lowering gives each layer's bytes of
    the scratch export back to the disk once that layer is lowered, so the export and the
    artifact never both hold every layer (GBs at the peak of a 1.5B float32 target). The
    bundle is still the cached build's; with release() disabled ("broken") the export keeps
    every byte, which the same measurement must see."""
    if not _punches_holes(tmp_path):
        pytest.skip("this filesystem cannot free a file's ranges (fallocate PUNCH_HOLE)")
    if release == "broken":
        monkeypatch.setattr(PortableWeights, "release", lambda self, names: None)
    out = tmp_path / "out" / "tiny"
    seen: dict[str, tuple[int, int, int, int]] = {}

    def progress(stage: str, how: str, seconds: float) -> None:  # called as each stage ends
        if stage == "onnxruntime target":  # the target's export is still on disk here
            graph = next(out.parent.glob(f"*/.scratch/exports/*/onnx/{GRAPH_FILE}"))
            layers = [e for n, e in PortableWeights(graph).entries.items()
                      if n.startswith("model.layers.")]
            data = graph.with_name(DATA_FILE).stat()
            seen[stage] = (data.st_size, data.st_blocks * 512, sum(e[2] for e in layers),
                           len(layers))

    result = build_bundle(make_plan(load_recipe(recipe)), cache=None, out=out, jobs=1,
                          progress=progress)
    size, allocated, layer_bytes, tensors = seen["onnxruntime target"]
    # a freed range keeps at most its two partial pages allocated
    assert layer_bytes > 2 * 4096 * tensors
    if release == "kept":
        assert allocated <= size - layer_bytes + 2 * 4096 * tensors
    else:
        assert allocated >= size - 4096
    cached = build(recipe, tmp_path / "cache", tmp_path / "cached" / "tiny")
    assert result.bundle_id == cached.bundle_id and verify_bundle(out) == []


def test_released_weights_are_never_read_as_zeros(recipe, tmp_path):
    """What release() freed reads back as zeros on disk: reading it again is an error; a
    graph that is not being spent (a cached export) keeps every tensor readable."""
    build(recipe, tmp_path / "cache", tmp_path / "out" / "tiny")
    graph = next(g for g in (tmp_path / "cache" / "exports").glob(f"*/onnx/{GRAPH_FILE}")
                 if PortableWeights(g).has("model.layers.1.mlp.down_proj.weight^T"))  # target
    first = "model.layers.0.mlp.down_proj.weight^T"
    kept = PortableWeights(graph)
    kept.release([first])
    assert kept.get(first).any()
    copy = tmp_path / "spent"
    shutil.copytree(graph.parent, copy)
    spent = PortableWeights(copy / GRAPH_FILE, spend=True)
    spent.release([first])
    with pytest.raises(QpcbuildError, match="after releasing it"):
        spent.get(first)
    assert spent.get("model.layers.1.mlp.down_proj.weight^T").any()


def test_failed_first_build_leaves_no_bundle(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(OrtBackend, "build", _fail_ort)
    out = tmp_path / "out" / "tiny"
    with pytest.raises(ToolchainError, match="injected"):
        build(recipe, tmp_path / "cache", out)
    assert not out.exists() and leftovers(out) == []


def test_refuses_to_replace_a_folder_that_is_not_a_bundle(recipe, tmp_path):
    out = tmp_path / "out" / "tiny"
    out.mkdir(parents=True)
    (out / "precious.txt").write_text("keep me\n")
    with pytest.raises(UsageError, match="not a qpcbuild bundle"):
        build(recipe, tmp_path / "cache", out)
    assert files_on_disk(out) == ["precious.txt"] and leftovers(out) == []


# ---------------------------------------------------------------- concurrency
def test_concurrent_builds_share_one_cache(recipe, tmp_path, monkeypatch):
    real = export_mod.export_model
    calls: list[str] = []

    def slow_export(src, role, *args, **kwargs):  # widen the window in which both builds run
        calls.append(role)
        time.sleep(0.3)
        return real(src, role, *args, **kwargs)

    monkeypatch.setattr(export_mod, "export_model", slow_export)
    cache, barrier = tmp_path / "cache", threading.Barrier(2)
    results: dict[str, BuildResult] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            barrier.wait()
            results[name] = build(recipe, cache, tmp_path / name / "tiny", jobs=1)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert results["a"].bundle_id == results["b"].bundle_id
    assert sorted(calls) == ["draft", "target"]  # each export written once
    for stage in reuse(results["a"]):
        assert sorted([reuse(results["a"])[stage], reuse(results["b"])[stage]]) == \
            [False, True], stage
    assert verify_bundle(results["a"].bundle) == verify_bundle(results["b"].bundle) == []
    assert cache_temp_dirs(cache) == []


def test_concurrent_cli_processes_share_one_cache(recipe, tmp_path):
    cache = tmp_path / "cache"
    code = "from qpcbuild.cli import app; app()"
    procs = [subprocess.Popen([sys.executable, "-c", code, "compile", str(recipe), "-o",
                               str(tmp_path / name / "tiny"), "--cache-dir", str(cache), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr
    ids = {json.loads(stdout)["bundle_id"] for stdout, _ in outs}
    assert len(ids) == 1
    assert verify_bundle(tmp_path / "a" / "tiny") == verify_bundle(tmp_path / "b" / "tiny") == []
    assert cache_temp_dirs(cache) == []


# ---------------------------------------------------------------- CLI
def test_package_is_reproducible_and_unpacks_to_a_valid_bundle(bundle, tmp_path):
    a, b = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    for archive in (a, b):
        result = runner.invoke(app, ["package", str(bundle), "-o", str(archive)])
        assert result.exit_code == 0, result.output
    assert a.read_bytes() == b.read_bytes()

    dest = tmp_path / "unpacked"
    result = runner.invoke(app, ["unpack", str(a), "-d", str(dest)])
    assert result.exit_code == 0, result.output
    unpacked = dest / "tiny"
    assert files_on_disk(unpacked) == files_on_disk(bundle)
    result = runner.invoke(app, ["verify", str(unpacked)])
    assert result.exit_code == 0, result.output
    assert verify_bundle(unpacked) == []
    # Packing the unpacked copy reproduces the archive byte for byte.
    c = tmp_path / "c.tar.gz"
    assert runner.invoke(app, ["package", str(unpacked), "-o", str(c)]).exit_code == 0
    assert c.read_bytes() == a.read_bytes()


def test_package_refuses_a_folder_without_manifest(tmp_path):
    folder = tmp_path / "not-a-bundle"
    folder.mkdir()
    (folder / "x.txt").write_text("x")
    result = runner.invoke(app, ["package", str(folder), "-o", str(tmp_path / "x.tar.gz")])
    assert result.exit_code == 2 and "manifest.json" in result.stderr
    assert not (tmp_path / "x.tar.gz").exists()


def test_cli_compile_json(recipe, tmp_path):
    out = tmp_path / "out" / "tiny"
    result = runner.invoke(app, ["compile", str(recipe), "-o", str(out), "--cache-dir",
                                 str(tmp_path / "cache"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["bundle"] == str(out)
    assert data["bundle_id"] == read_manifest(out).bundle_id
    assert {s["stage"] for s in data["stages"]} == {
        "export target", "export draft", "onnxruntime target", "onnxruntime draft"}
    assert all(isinstance(s["reused"], bool) for s in data["stages"])
    assert verify_bundle(out) == []


@pytest.mark.parametrize("edit, key", [
    (lambda t: t.replace("num_speculative_tokens: 3", "num_speculative_tokens: 40"),
     "speculation.num_speculative_tokens"),
    (lambda t: t.replace("ctx_len: 64", "ctx_len: 64\n  ctx_lenn: 3"), "ctx_lenn"),
    (lambda t: t.replace("/draft\n", "/no-such-draft\n"), "draft.model"),
])
def test_cli_compile_bad_recipe_exits_2(recipe, tmp_path, edit, key):
    recipe.write_text(edit(recipe.read_text()))
    out, cache = tmp_path / "out" / "tiny", tmp_path / "cache"
    result = runner.invoke(app, ["compile", str(recipe), "-o", str(out), "--cache-dir",
                                 str(cache), "--json"])
    assert result.exit_code == 2, result.output
    assert key in result.stderr
    # --json: the error as JSON on stdout too, for CI to parse
    assert json.loads(result.stdout)["error"]["code"] == 2 and key in result.stdout
    assert not out.exists() and not (cache / "exports").exists()


def test_cli_inspect(bundle):
    result = runner.invoke(app, ["inspect", str(bundle)])
    assert result.exit_code == 0, result.output
    assert "tiny" in result.stdout
    assert "target" in result.stdout and "draft" in result.stdout
    as_json = runner.invoke(app, ["inspect", str(bundle), "--json"])
    assert as_json.exit_code == 0
    assert json.loads(as_json.stdout) == read_manifest(bundle).to_json_dict()


def test_cli_inspect_rejects_non_bundle(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 2 and "manifest.json" in result.stderr

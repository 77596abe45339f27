"""BuildPlan: specializations, custom IO, MDP partitions, compiler argv, cores, memory, cache
keys and tokenizer verdicts. Plans read configs only (known-models table or tiny local folders),
so every test here runs without network or weights."""

from __future__ import annotations

import copy
import json
import shutil
import shlex
import socket
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from qpcbuild.errors import RecipeError
from qpcbuild.plan import BuildPlan, make_plan, specializations
from qpcbuild.backends.qaic.plan import custom_io_yaml, specializations_file
from qpcbuild.recipe import Shapes, load_recipe, recipe_from_text, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
REFERENCE = RECIPES / "llama8b-1b.yaml"
NGRAM = RECIPES / "llama8b-ngram.yaml"


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path_factory, monkeypatch):
    """Plans must not depend on what this machine happens to have in its Hugging Face cache."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf-cache")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def plan_of(path: Path = REFERENCE, *overrides: str) -> BuildPlan:
    return make_plan(load_recipe(path, list(overrides)), compiler="qaic-compile")


def symbols(plan: BuildPlan, role: str) -> list[dict[str, str]]:
    return [s.symbols for s in plan.role(role).specializations]


def names(plan: BuildPlan, role: str) -> list[str]:
    return [s.name for s in plan.role(role).specializations]


# ---------------------------------------------------------------- specializations
def test_target_specializations_prefill_and_k_plus_1_decode():
    p = plan_of()
    assert p.method == "draft_model" and p.ks == (3,)
    assert [s.model_dump() for s in p.role("target").specializations] == [
        {"name": "Prefill", "symbols": {"batch_size": "4", "seq_len": "128", "ctx_len": "2048",
                                        "num_logits_to_keep": "1"}},
        {"name": "Decode", "symbols": {"batch_size": "4", "seq_len": "4", "ctx_len": "2048",
                                       "num_logits_to_keep": "4"}},
    ]
    for role in ("target", "draft"):
        assert all(isinstance(v, str) for s in symbols(p, role) for v in s.values())


def test_draft_specializations_prefill_and_single_token_decode():
    p = plan_of()
    assert [s.model_dump() for s in p.role("draft").specializations] == [
        {"name": "Prefill", "symbols": {"batch_size": "4", "seq_len": "128", "ctx_len": "2048"}},
        {"name": "Decode", "symbols": {"batch_size": "4", "seq_len": "1", "ctx_len": "2048"}},
    ]
    assert p.role("draft").ks == ()


def test_draft_decode_omitted_when_prefill_is_one_token():
    # No valid draft_model recipe has prefill_seq_len 1 (it needs K >= 1 and prefill >= K+1),
    # so the rule of reference section 2 is checked on the planner's function directly.
    r = load_recipe(REFERENCE)
    one = r.model_copy(update={"shapes": Shapes(batch_size=2, prefill_seq_len=1, ctx_len=64)})
    assert [s.model_dump() for s in specializations("draft", one, ())] == [
        {"name": "Prefill", "symbols": {"batch_size": "2", "seq_len": "1", "ctx_len": "64"}}]
    cb = r.model_copy(update={"shapes": Shapes(batch_size=2, full_batch_size=4,
                                               prefill_seq_len=1, ctx_len=64)})
    assert [s.name for s in specializations("draft", cb, ())] == ["Prefill", "Decode"]


def test_ngram_compiles_k0_and_k():
    p = plan_of(NGRAM)
    assert p.method == "ngram" and p.ks == (0, 5)
    assert [r.role for r in p.roles] == ["target"]
    assert p.method_options == {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert names(p, "target") == ["Prefill", "Decode_0", "Decode_1"]
    prefill, decode0, decode1 = symbols(p, "target")
    assert prefill == {"batch_size": "4", "seq_len": "128", "ctx_len": "4096",
                       "num_logits_to_keep": "1"}
    assert decode0 == {"batch_size": "4", "seq_len": "1", "ctx_len": "4096",
                       "num_logits_to_keep": "1"}
    assert decode1 == {"batch_size": "4", "seq_len": "6", "ctx_len": "4096",
                       "num_logits_to_keep": "6"}
    assert p.tokenizer["verdict"] == "not-applicable"


def test_k_list_is_sorted_and_named_with_suffixes():
    p = plan_of(REFERENCE, "speculation.num_speculative_tokens=[4, 2]")
    assert p.ks == (2, 4)
    assert names(p, "target") == ["Prefill", "Decode_0", "Decode_1"]
    assert [s["seq_len"] for s in symbols(p, "target")] == ["128", "3", "5"]
    assert [s["num_logits_to_keep"] for s in symbols(p, "target")] == ["1", "3", "5"]


def test_flat_and_named_specializations_files():
    target = plan_of().role("target")
    named = specializations_file(target.specializations, "named")
    flat = specializations_file(target.specializations, "flat")
    assert [e["name"] for e in named["specializations"]] == ["Prefill", "Decode"]
    assert flat == {"specializations": [
        {"batch_size": "4", "seq_len": "128", "ctx_len": "2048", "num_logits_to_keep": "1"},
        {"batch_size": "4", "seq_len": "4", "ctx_len": "2048", "num_logits_to_keep": "4"}]}
    assert json.loads(json.dumps(flat)) == flat
    # The recipe option only selects which file is written; it is part of the qaic cache key.
    flat_plan = plan_of(REFERENCE, "hardware.specializations_format=flat")
    assert flat_plan.role("target").specializations == target.specializations
    assert flat_plan.role("target").cache_keys.backends["qaic"] != target.cache_keys.backends["qaic"]


def test_continuous_batching_specializations_and_io():
    p = plan_of(REFERENCE, "shapes.full_batch_size=8")
    assert symbols(p, "target") == [
        {"batch_size": "1", "seq_len": "128", "ctx_len": "2048", "num_logits_to_keep": "1",
         "full_batch_size": "8"},
        {"batch_size": "8", "seq_len": "4", "ctx_len": "2048", "num_logits_to_keep": "4",
         "full_batch_size": "8"}]
    assert symbols(p, "draft") == [
        {"batch_size": "1", "seq_len": "128", "ctx_len": "2048", "full_batch_size": "8"},
        {"batch_size": "8", "seq_len": "1", "ctx_len": "2048", "full_batch_size": "8"}]
    for role in ("target", "draft"):
        inputs = {i.name: i for i in p.role(role).io.inputs}
        assert inputs["batch_index"].shape == ("batch_size", 1)
        assert inputs["past_key.0"].shape[0] == "full_batch_size"
    assert "batch_index" not in {i.name for i in plan_of().role("target").io.inputs}


def test_graph_io_pairs_every_kv_input_with_retained_state():
    p = plan_of()
    for rp in p.roles:
        ins = [i.name for i in rp.io.inputs]
        outs = [o.name for o in rp.io.outputs]
        kv = [n for n in ins if n.startswith("past_")]
        assert len(kv) == 2 * rp.arch.num_layers
        assert kv[:4] == ["past_key.0", "past_value.0", "past_key.1", "past_value.1"]
        assert [n for n in outs if n.startswith("past_")] == [n + "_RetainedState" for n in kv]
        assert ins[:2] == ["input_ids", "position_ids"]
        assert ("num_logits_to_keep" in ins) == (rp.role == "target")
        assert ins[-1] == ("num_logits_to_keep" if rp.role == "target" else kv[-1])
    logits = {rp.role: rp.io.to_dict()["outputs"][0]["shape"] for rp in p.roles}
    assert logits == {"target": ["batch_size", "num_logits_to_keep", 128256],
                      "draft": ["batch_size", 1, 128256]}


# ---------------------------------------------------------------- custom IO and MDP
def test_custom_io_two_entries_per_kv_tensor_per_layer_mxint8():
    p = plan_of()
    for rp in p.roles:
        layers = rp.arch.num_layers
        expected = [f"past_{kind}.{i}{suffix}" for i in range(layers) for kind in ("key", "value")
                    for suffix in ("", "_RetainedState")]
        assert [e["IOName"] for e in rp.backends["qaic"].custom_io] == expected
        assert len(rp.backends["qaic"].custom_io) == 4 * layers
        assert {e["Precision"] for e in rp.backends["qaic"].custom_io} == {"mxint8"}
    assert (p.role("target").arch.num_layers, p.role("draft").arch.num_layers) == (32, 16)
    text = custom_io_yaml(p.role("draft").backends["qaic"].custom_io)
    assert text.startswith(" - IOName: past_key.0\n   Precision: mxint8\n\n"
                           " - IOName: past_key.0_RetainedState\n   Precision: mxint8\n\n")
    assert yaml.safe_load(text) == p.role("draft").backends["qaic"].custom_io


def test_custom_io_follows_kv_dtype():
    p = plan_of(REFERENCE, "precision.kv_cache_dtype=float16")
    assert {e["Precision"] for rp in p.roles
            for e in rp.backends["qaic"].custom_io} == {"float16"}


def test_mdp_partition_four_devices_with_role_cores():
    p = plan_of()
    for role, cores in (("target", 10), ("draft", 6)):
        assert p.role(role).backends["qaic"].mdp_partition == {
            "connections": [{"devices": [0, 1, 2, 3], "type": "p2p"}],
            "partitions": [{"name": "Partition0",
                            "devices": [{"deviceId": d, "numCores": cores} for d in range(4)]}]}
        assert p.role(role).num_cores == cores
        assert p.role(role).device_group == [0, 1, 2, 3]


def test_single_device_has_no_mdp_partition():
    p = plan_of(REFERENCE, "hardware.target.device_group=[2]", "hardware.draft.device_group=[3]")
    for rp in p.roles:
        assert rp.backends["qaic"].mdp_partition is None
        assert not any(a.startswith("-mdp-load-partition-config")
                       for a in rp.backends["qaic"].compiler_argv)


# ---------------------------------------------------------------- compiler argv
def test_compiler_argv_reference_token_order():
    p = plan_of()
    assert p.role("target").backends["qaic"].compiler_argv == [
        "qaic-compile", "-aic-hw", "-aic-hw-version=ai100", "-m=target/onnx/model.onnx",
        "-retained-state", "-convert-to-fp16", "-mxfp6-matmul", "-aic-num-cores=10",
        "-aic-enable-depth-first", "-mdp-load-partition-config=target/qaic/mdp_ts_4.json",
        "-network-specialization-config=target/qaic/specializations.json",
        "-custom-IO-list-file=target/qaic/custom_io.yaml", "-aic-binary-dir=target/qpc"]
    assert p.role("draft").backends["qaic"].compiler_argv == [
        "qaic-compile", "-aic-hw", "-aic-hw-version=ai100", "-m=draft/onnx/model.onnx",
        "-retained-state", "-convert-to-fp16", "-mxfp6-matmul", "-aic-num-cores=6",
        "-aic-enable-depth-first", "-mdp-load-partition-config=draft/qaic/mdp_ts_4.json",
        "-network-specialization-config=draft/qaic/specializations.json",
        "-custom-IO-list-file=draft/qaic/custom_io.yaml", "-aic-binary-dir=draft/qpc"]
    roles = p.to_dict()["roles"]
    assert roles["target"]["backends"]["qaic"]["compiler_command"] == \
        shlex.join(p.role("target").backends["qaic"].compiler_argv)


def test_compiler_argv_optional_flags_in_order():
    p = plan_of(REFERENCE, "hardware.compiler_options.mos=2",
                "hardware.compiler_options.allow_mxint8_mdp_io=true",
                "hardware.compiler_options.extra_flags=[-stats-level=70, -v]",
                "hardware.aic_hw_version=ai200", "precision.quantization=none")
    assert p.role("target").backends["qaic"].compiler_argv == [
        "qaic-compile", "-aic-hw", "-aic-hw-version=ai200", "-m=target/onnx/model.onnx",
        "-retained-state", "-convert-to-fp16", "-aic-num-cores=10", "-aic-enable-depth-first",
        "-mos=2", "-allow-mxint8-mdp-io", "-stats-level=70", "-v",
        "-mdp-load-partition-config=target/qaic/mdp_ts_4.json",
        "-network-specialization-config=target/qaic/specializations.json",
        "-custom-IO-list-file=target/qaic/custom_io.yaml", "-aic-binary-dir=target/qpc"]


def test_explicit_compiler_path_is_argv0(tmp_path):
    fake = tmp_path / "qaic-exec"
    p = make_plan(load_recipe(REFERENCE), compiler=str(fake))
    assert p.role("target").backends["qaic"].compiler_argv[0] == str(fake)


# ---------------------------------------------------------------- cores and memory
def test_core_table_reference_split():
    p = plan_of()
    assert p.cores_per_qid == [{"qid": q, "target": 10, "draft": 6, "free": 0} for q in range(4)]
    for row in p.cores_per_qid:
        assert row["target"] + row["draft"] <= 16


@pytest.mark.parametrize("overrides, target, draft", [
    (("hardware.target.num_cores=null", "hardware.draft.num_cores=null"), 8, 8),
    (("hardware.target.num_cores=null", "hardware.draft.num_cores=5"), 11, 5),
    (("hardware.target.num_cores=12", "hardware.draft.num_cores=null"), 12, 4),
], ids=["default-8-8", "draft-given", "target-given"])
def test_core_split_on_shared_device_group(overrides, target, draft):
    p = plan_of(REFERENCE, *overrides)
    assert (p.role("target").num_cores, p.role("draft").num_cores) == (target, draft)
    for row in p.cores_per_qid:
        assert row == {"qid": row["qid"], "target": target, "draft": draft,
                       "free": 16 - target - draft}
        assert row["target"] + row["draft"] <= 16
    assert f"-aic-num-cores={target}" in p.role("target").backends["qaic"].compiler_argv


def test_separate_device_groups_get_whole_qids():
    p = plan_of(REFERENCE, "hardware.target.device_group=[0, 1]",
                "hardware.draft.device_group=[2]", "hardware.target.num_cores=null",
                "hardware.draft.num_cores=null")
    assert p.cores_per_qid == [{"qid": 0, "target": 16, "draft": 0, "free": 0},
                               {"qid": 1, "target": 16, "draft": 0, "free": 0},
                               {"qid": 2, "target": 0, "draft": 16, "free": 0}]


def test_memory_estimate_positive_and_no_warning_for_reference():
    p = plan_of()
    for rp in p.roles:
        assert rp.memory.weights_gib > 0 and rp.memory.kv_cache_gib > 0
    assert p.dram_gib_per_qid == 32
    assert [row["qid"] for row in p.memory_per_qid] == [0, 1, 2, 3]
    for row in p.memory_per_qid:
        assert 0 < row["total"] <= 32
        assert row["total"] == pytest.approx(sum(v for k, v in row.items()
                                                 if k not in ("qid", "total")), abs=1e-2)
    assert not any("on-board memory" in w for w in p.warnings)
    # KV: 2 (k, v) x 32 layers x 8 heads x 128 x 33/32 bytes x 2048 positions x 4 rows, over 4 QIDs
    expected = 2 * 32 * 8 * 128 * (33 / 32) * 2048 * 4 / 2**30 / 4
    assert p.role("target").memory.kv_cache_gib == pytest.approx(expected)


def test_memory_warning_when_kv_exceeds_qid_dram():
    p = plan_of(REFERENCE, "shapes.ctx_len=131072", "shapes.batch_size=64")
    assert p.role("target").memory.kv_cache_gib > 32
    warnings = [w for w in p.warnings if "on-board memory" in w]
    assert len(warnings) == 4  # one per QID
    assert "QID 0" in warnings[0] and "32 GiB" in warnings[0]


def test_mxfp6_shrinks_weights():
    fp16 = plan_of(REFERENCE, "precision.quantization=none").role("target").memory.weights_gib
    mx = plan_of().role("target").memory.weights_gib
    assert 0 < mx < fp16 / 2


# ---------------------------------------------------------------- cache keys
def _keys(p: BuildPlan, kind: str = "export") -> dict[str, str]:
    return {rp.role: rp.cache_keys.to_dict()[kind] for rp in p.roles}


def test_cache_keys_are_deterministic():
    assert _keys(plan_of()) == _keys(plan_of())
    assert _keys(plan_of(), "qaic") == _keys(plan_of(), "qaic")


@pytest.mark.parametrize("overrides", [
    ("speculation.num_speculative_tokens=5",),
    ("speculation.num_speculative_tokens=[0, 3]",),
    ("hardware.target.num_cores=11", "hardware.draft.num_cores=5"),
    ("shapes.ctx_len=4096",),
], ids=["k", "k-list", "num-cores", "ctx-len"])
def test_export_keys_ignore_compile_only_changes(overrides):
    base, changed = plan_of(), plan_of(REFERENCE, *overrides)
    assert _keys(changed) == _keys(base)
    assert _keys(changed, "qaic")["target"] != _keys(base, "qaic")["target"]


def test_changing_the_draft_keeps_the_target_export_key():
    base = plan_of()
    other = plan_of(REFERENCE, "draft.model=meta-llama/Llama-3.2-3B-Instruct")
    assert other.role("target").cache_keys == base.role("target").cache_keys
    assert other.role("draft").cache_keys.export != base.role("draft").cache_keys.export


def test_export_dtype_changes_export_keys():
    base = plan_of()
    fp16 = plan_of(REFERENCE, "precision.export_dtype=float16")
    for role in ("target", "draft"):
        assert fp16.role(role).cache_keys.export != base.role(role).cache_keys.export
    # the graph computes in float32 with float16 weights too: its KV I/O stays float32
    assert fp16.role("target").io.inputs[2].dtype == "float32"
    assert any("export_dtype float16" in w for w in fp16.warnings)
    assert not any("export_dtype" in w for w in base.warnings)


# ---------------------------------------------------------------- offline and fast
def test_plan_needs_no_network_and_no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("make_plan tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    p = plan_of()
    for rp in p.roles:
        assert rp.source.origin == "known-models" and rp.source.path is None
    assert p.tokenizer["verdict"] == "same-family"
    assert any(w.startswith("tokenizers:") for w in p.warnings)


def _shipped_plannable() -> list[Path]:
    out = []
    for path in sorted(RECIPES.glob("*.yaml")):
        r = load_recipe(path)
        refs = [r.target.model] + ([r.draft.model] if r.draft.model else [])
        if all(not ref.startswith((".", "/", "~")) or Path(resolve_model_path(r, ref)).is_dir()
               for ref in refs):
            out.append(path)
    return out


def test_shipped_recipes_plan_and_serialize():
    shipped = _shipped_plannable()
    assert {REFERENCE, NGRAM} <= set(shipped)
    for path in shipped:
        p = make_plan(load_recipe(path))
        doc = json.loads(json.dumps(p.to_dict()))
        assert doc["ks"] == list(p.ks) and set(doc["roles"]) == {rp.role for rp in p.roles}
        for rp in p.roles:
            assert sum(row[rp.role] for row in p.cores_per_qid) == \
                rp.num_cores * len(rp.device_group)
        for row in p.cores_per_qid:
            assert row["free"] >= 0


# ---------------------------------------------------------------- tokenizers
VOCAB = ["<s>", "</s>", "a", "b", "c", "ab", "abc", "ba"]


def _write_model(folder: Path, vocab: list[str], vocab_size: int, layers: int = 2) -> Path:
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": vocab_size,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 0,
              "eos_token_id": 1}
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i, t in enumerate(vocab[:2])]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
                 "normalizer": None, "pre_tokenizer": None, "post_processor": None,
                 "decoder": None,
                 "model": {"type": "BPE", "dropout": None, "unk_token": None,
                           "continuing_subword_prefix": None, "end_of_word_suffix": None,
                           "fuse_unk": False, "byte_fallback": False,
                           "vocab": {t: i for i, t in enumerate(vocab)},
                           # only merges of tokens the vocabulary holds: a tokenizer that
                           # names others is unreadable, which is a different error
                           "merges": [m for m in ("a b", "ab c", "b a") if all(
                               s in vocab for s in (*m.split(), m.replace(" ", "")))]}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1))
    return folder


def _pair_recipe(tmp_path: Path, target: str = "./target", draft: str = "./draft") -> Path:
    path = tmp_path / "pair.yaml"
    path.write_text("schema: 1\nname: tiny-pair\ntarget:\n  model: " + target + "\n"
                    "draft:\n  method: draft_model\n  model: " + draft + "\n"
                    "speculation:\n  num_speculative_tokens: 3\nbackends: [onnxruntime]\n")
    return path


def test_hand_written_tokenizer_is_a_real_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    folder = _write_model(tmp_path / "m", VOCAB, len(VOCAB))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode("abcba", add_special_tokens=False).tokens == ["abc", "ba"]


def test_tokenizers_identical(tmp_path):
    _write_model(tmp_path / "target", VOCAB, len(VOCAB), layers=4)
    _write_model(tmp_path / "draft", VOCAB, len(VOCAB), layers=2)
    p = make_plan(load_recipe(_pair_recipe(tmp_path)))
    assert p.tokenizer["verdict"] == "identical"
    assert p.tokenizer["target_digest"] == p.tokenizer["draft_digest"] is not None
    assert not any(w.startswith("tokenizers:") for w in p.warnings)
    assert {rp.source.origin for rp in p.roles} == {"local"}


def test_tokenizers_target_padded(tmp_path):
    _write_model(tmp_path / "target", VOCAB, 64, layers=4)
    _write_model(tmp_path / "draft", VOCAB, len(VOCAB))
    p = make_plan(load_recipe(_pair_recipe(tmp_path)))
    assert p.tokenizer["verdict"] == "target-padded"
    assert "64" in p.tokenizer["detail"] and str(len(VOCAB)) in p.tokenizer["detail"]
    assert p.role("target").arch.vocab_size == 64


def test_tokenizers_incompatible_token_string(tmp_path):
    _write_model(tmp_path / "target", VOCAB, len(VOCAB), layers=4)
    _write_model(tmp_path / "draft", VOCAB[:4] + ["d"] + VOCAB[5:], len(VOCAB))
    with pytest.raises(RecipeError) as info:
        make_plan(load_recipe(_pair_recipe(tmp_path)))
    (problem,) = info.value.problems
    assert problem.path == "draft.model" and problem.line == 7
    assert "incompatible" in problem.message
    assert "id 4" in problem.message and "'c'" in problem.message and "'d'" in problem.message


def test_a_remembered_tokenizer_verdict_follows_the_files(tmp_path):
    """compile remembers the verdict in the cache's digests folder; changing a token in the
    draft's tokenizer.json (or its config) must be seen, not answered from memory."""
    memo = tmp_path / "digests"
    _write_model(tmp_path / "target", VOCAB, len(VOCAB), layers=4)
    _write_model(tmp_path / "draft", VOCAB, len(VOCAB), layers=2)
    recipe = _pair_recipe(tmp_path)
    assert make_plan(load_recipe(recipe), memo_dir=memo).tokenizer["verdict"] == "identical"
    (remembered,) = memo.glob("tokenizers-*.json")
    assert make_plan(load_recipe(recipe), memo_dir=memo).tokenizer["verdict"] == "identical"
    shutil.rmtree(tmp_path / "draft")
    _write_model(tmp_path / "draft", VOCAB[:4] + ["d"] + VOCAB[5:], len(VOCAB), layers=2)
    with pytest.raises(RecipeError, match="id 4"):
        make_plan(load_recipe(recipe), memo_dir=memo)
    shutil.rmtree(tmp_path / "draft")
    _write_model(tmp_path / "draft", VOCAB, 100, layers=2)  # the first tokenizer, other config
    with pytest.raises(RecipeError, match="vocab_size 100"):
        make_plan(load_recipe(recipe), memo_dir=memo)
    assert remembered.is_file() and len(list(memo.glob("tokenizers-*.json"))) == 3


def test_tokenizers_incompatible_larger_draft_vocab(tmp_path):
    _write_model(tmp_path / "target", VOCAB, len(VOCAB), layers=4)
    _write_model(tmp_path / "draft", VOCAB, 100)
    with pytest.raises(RecipeError) as info:
        make_plan(load_recipe(_pair_recipe(tmp_path)))
    assert info.value.problems[0].path == "draft.model"
    assert "vocab_size 100" in info.value.problems[0].message


def test_tokenizer_families_differ_in_known_models():
    r = recipe_from_text("schema: 1\nname: mixed\ntarget: {model: Qwen/Qwen2.5-7B-Instruct}\n"
                         "draft:\n  model: Qwen/Qwen3-0.6B\n")
    with pytest.raises(RecipeError) as info:
        make_plan(r)
    assert info.value.problems[0].path == "draft.model"
    assert info.value.problems[0].line == 5
    assert "'qwen2'" in info.value.problems[0].message


def test_unknown_model_explains_how_to_get_it(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("schema: 1\nname: unknown\ntarget:\n  model: acme-labs/no-such-model-7b\n"
                    "  revision: v2\ndraft:\n  method: ngram\n")
    with pytest.raises(RecipeError) as info:
        make_plan(load_recipe(path))
    (problem,) = info.value.problems
    assert problem.path == "target.model" and problem.line == 4
    assert "hf download acme-labs/no-such-model-7b --revision v2" in problem.message
    assert "HF_TOKEN" in problem.message


def test_both_unknown_models_are_reported_together(tmp_path):
    path = _pair_recipe(tmp_path, "acme/t-1", "acme/d-1")
    with pytest.raises(RecipeError) as info:
        make_plan(load_recipe(path))
    assert [p.path for p in info.value.problems] == ["target.model", "draft.model"]
    assert all("hf download" in p.message for p in info.value.problems)


@pytest.mark.parametrize("ref, fragment", [
    ("./absent-folder", "does not exist"),
    ("~qpcbuild-no-such-user/model", "neither a usable folder path"),
    ("x" * 5000, "neither a usable folder path"),
], ids=["missing-folder", "unknown-user-home", "name-too-long"])
def test_unusable_model_paths_are_recipe_errors(tmp_path, ref, fragment):
    path = _pair_recipe(tmp_path, target=ref, draft="meta-llama/Llama-3.2-1B-Instruct")
    with pytest.raises(RecipeError) as info:
        make_plan(load_recipe(path))
    assert info.value.problems[0].path == "target.model"
    assert fragment in info.value.problems[0].message


def test_folder_without_config_is_a_recipe_error(tmp_path):
    (tmp_path / "target").mkdir()
    _write_model(tmp_path / "draft", VOCAB, len(VOCAB))
    with pytest.raises(RecipeError) as info:
        make_plan(load_recipe(_pair_recipe(tmp_path)))
    assert info.value.problems[0].path == "target.model"
    assert "no config.json" in info.value.problems[0].message


# ---------------------------------------------------------------- property-based
BASE_DOC = yaml.safe_load(REFERENCE.read_text())
LEAVES = (st.none() | st.booleans() | st.integers(-2, 70) | st.sampled_from([0, 1, 8, 16, 17, 1024,
                                                                            131072, 2**40])
          | st.sampled_from(["ngram", "suffix", "draft_model", "qaic", "onnxruntime", "mxint8",
                             "float16", "mxfp6", "none", "flat", "ai200", "cloud-ai-100-pro",
                             "cloud-ai-100-standard", "meta-llama/Llama-3.2-3B-Instruct",
                             "Qwen/Qwen3-0.6B", "acme/none", "~", "./x"])
          | st.lists(st.integers(-1, 8), max_size=5))


def _leaf_paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield prefix + (key,)
            yield from _leaf_paths(value, prefix + (key,))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_plan_of_any_valid_variant_is_a_plan_or_a_recipe_error(data):
    doc = copy.deepcopy(BASE_DOC)
    for _ in range(data.draw(st.integers(1, 4), label="changes")):
        path = data.draw(st.sampled_from(list(_leaf_paths(doc))), label="path")
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        if data.draw(st.booleans(), label="delete"):
            if path[-1] not in ("schema", "name", "target", "model"):
                del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(LEAVES, label="value")
    try:
        p = make_plan(recipe_from_text(yaml.safe_dump(doc)), compiler="qaic-compile")
    except RecipeError as exc:
        assert exc.problems
        event("recipe error")
        return
    event("plan")
    json.dumps(p.to_dict())
    for row in p.cores_per_qid:
        assert sum(v for k, v in row.items() if k in ("target", "draft")) <= 16
    target = p.role("target")
    assert [s.symbols["seq_len"] for s in target.specializations[1:]] == \
        [str(k + 1) for k in p.ks]

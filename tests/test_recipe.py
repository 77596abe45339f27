"""Recipe loading and validation: every bad input is a RecipeError naming the key and line.

The base recipe below is valid and resolves offline through the shipped known-models table.
Bad recipes are derived from it by replacing whole lines, so line numbers stay predictable.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qpcbuild.cli import app
from qpcbuild.errors import RecipeError
from qpcbuild.recipe import Recipe, load_recipe, recipe_from_text, resolve_model_path
from qpcbuild.recipe.file import MAX_RECIPE_BYTES

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))

TARGET = "meta-llama/Llama-3.1-8B-Instruct"
DRAFT = "meta-llama/Llama-3.2-1B-Instruct"

BASE = f"""\
schema: 1
name: base-pair
target:
  model: {TARGET}
draft:
  method: draft_model
  model: {DRAFT}
speculation:
  num_speculative_tokens: 3
shapes:
  batch_size: 1
  prefill_seq_len: 32
  ctx_len: 256
precision:
  quantization: none
  kv_cache_dtype: float16
hardware:
  card: cloud-ai-100-ultra
  aic_hw_version: ai100
  target:
    device_group: [0]
    num_cores: 10
  draft:
    device_group: [0]
    num_cores: 6
backends: [onnxruntime]
"""
# Line of each key in BASE (checked by test_base_lines).
L_SCHEMA, L_NAME, L_TARGET, L_TARGET_MODEL = 1, 2, 3, 4
L_DRAFT, L_METHOD, L_DRAFT_MODEL = 5, 6, 7
L_K = 9
L_BATCH, L_PREFILL, L_CTX = 11, 12, 13
L_QUANT, L_KV = 15, 16
L_CARD, L_HW_VERSION = 18, 19
L_T_DEVICES, L_T_CORES, L_D_DEVICES, L_D_CORES = 21, 22, 24, 25
L_BACKENDS = 26

T_DEVICES = "  target:\n    device_group: [0]"
D_DEVICES = "  draft:\n    device_group: [0]"
DRAFT_MODEL_LINE = f"  model: {DRAFT}"
NGRAM = ("  method: draft_model", "  method: ngram")


def edit(*pairs: tuple[str, str]) -> str:
    """BASE with each `old` (which must occur exactly once) replaced by `new`."""
    text = BASE
    for old, new in pairs:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def problems_of(exc: RecipeError) -> str:
    return "\n".join(str(p) for p in exc.problems)


def assert_problem(exc: RecipeError, path: str, line: int | None = None,
                   fragment: str | None = None) -> None:
    """Some problem sits at `path` (or below it), on `line`, and mentions `fragment`."""
    assert exc.problems, "a RecipeError without problems"
    at_path = [p for p in exc.problems if p.path == path or p.path.startswith(path + ".")
               or p.path.startswith(path + "[")]
    assert at_path, f"no problem at {path!r}; got:\n{problems_of(exc)}"
    matching = [p for p in at_path
                if (line is None or p.line == line)
                and (fragment is None or fragment in p.message)]
    assert matching, f"no problem at {path!r} line {line} mentioning {fragment!r}; " \
                     f"got:\n{problems_of(exc)}"
    assert all(p.severity == "error" for p in exc.problems)


@dataclass(frozen=True)
class Bad:
    id: str
    text: str
    path: str
    line: int | None = None
    fragment: str | None = None
    overrides: tuple[str, ...] = ()


BILLION_LAUGHS = "\n".join(
    ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"{c}: &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]) + "\n"

BAD = [
    # ---- unknown keys, at several levels
    Bad("unknown-root-key", edit(("backends: [onnxruntime]", "backends: [onnxruntime]\n"
                                                           "backend: [qaic]")),
        "backend", L_BACKENDS + 1, "did you mean 'backends'?"),
    Bad("unknown-shapes-key", edit(("  batch_size: 1", "  batch_sise: 1")),
        "shapes.batch_sise", L_BATCH, "did you mean 'batch_size'?"),
    Bad("unknown-role-hardware-key", edit(("    num_cores: 10", "    num_core: 10")),
        "hardware.target.num_core", L_T_CORES, "did you mean 'num_cores'?"),
    Bad("unknown-compiler-option", edit(("  aic_hw_version: ai100", "  aic_hw_version: ai100\n"
                                         "  compiler_options:\n"
                                         "    aic_enable_depth_frist: true")),
        "hardware.compiler_options.aic_enable_depth_frist", L_HW_VERSION + 2,
        "did you mean 'aic_enable_depth_first'?"),
    Bad("unknown-draft-key", edit((DRAFT_MODEL_LINE, DRAFT_MODEL_LINE + "\n  temperature: 0.7")),
        "draft.temperature", L_DRAFT_MODEL + 1, "unknown key 'temperature'"),
    Bad("unknown-precision-key", edit(("  kv_cache_dtype: float16", "  kv_dtype: float16")),
        "precision.kv_dtype", L_KV, "unknown key 'kv_dtype'"),
    # ---- wrong types
    Bad("string-for-int", edit(("  ctx_len: 256", "  ctx_len: lots")),
        "shapes.ctx_len", L_CTX, "'lots'"),
    Bad("quoted-number-for-int", edit(("  batch_size: 1", '  batch_size: "4"')),
        "shapes.batch_size", L_BATCH, "'4'"),
    Bad("bool-for-int", edit(("  prefill_seq_len: 32", "  prefill_seq_len: true")),
        "shapes.prefill_seq_len", L_PREFILL, "True"),
    Bad("bool-for-k", edit(("  num_speculative_tokens: 3", "  num_speculative_tokens: yes")),
        "speculation.num_speculative_tokens", L_K, "True"),
    Bad("float-for-int", edit(("    num_cores: 10", "    num_cores: 10.5")),
        "hardware.target.num_cores", L_T_CORES, "10.5"),
    Bad("list-for-mapping", edit(("shapes:\n  batch_size: 1\n  prefill_seq_len: 32\n"
                                  "  ctx_len: 256", "shapes: [1, 32, 256]\n#\n#\n#")),
        "shapes", 10, "[1, 32, 256]"),
    Bad("int-for-string", edit((f"  model: {TARGET}", "  model: 8")),
        "target.model", L_TARGET_MODEL, "8"),
    Bad("int-for-name", edit(("name: base-pair", "name: 12345")), "name", L_NAME, "12345"),
    Bad("string-for-list", edit(("backends: [onnxruntime]", "backends: onnxruntime")),
        "backends", L_BACKENDS, "'onnxruntime'"),
    Bad("int-for-device-list", edit((T_DEVICES, "  target:\n    device_group: 0")),
        "hardware.target.device_group", L_T_DEVICES, "0"),
    Bad("string-for-target-mapping", edit(("target:\n  model", "target: x\n#model")),
        "target", L_TARGET, "'x'"),
    # ---- K
    Bad("k-negative", edit(("  num_speculative_tokens: 3", "  num_speculative_tokens: -1")),
        "speculation.num_speculative_tokens", L_K, "K=-1"),
    Bad("k-above-32", edit(("  num_speculative_tokens: 3", "  num_speculative_tokens: 33")),
        "speculation.num_speculative_tokens", L_K, "K=33"),
    Bad("k-list-negative", edit(("  num_speculative_tokens: 3",
                                 "  num_speculative_tokens: [1, -3]")),
        "speculation.num_speculative_tokens", L_K, "K=-3"),
    Bad("k-list-duplicates", edit(("  num_speculative_tokens: 3",
                                   "  num_speculative_tokens: [2, 2]")),
        "speculation.num_speculative_tokens", L_K, "duplicate values in [2, 2]"),
    Bad("k-list-empty", edit(("  num_speculative_tokens: 3", "  num_speculative_tokens: []")),
        "speculation.num_speculative_tokens", L_K, "empty list"),
    Bad("k-zero-draft-model", edit(("  num_speculative_tokens: 3",
                                    "  num_speculative_tokens: 0")),
        "speculation.num_speculative_tokens", L_K, "K >= 1"),
    Bad("k-list-of-strings", edit(("  num_speculative_tokens: 3",
                                   "  num_speculative_tokens: [a]")),
        "speculation.num_speculative_tokens", L_K, "'a'"),
    # ---- shapes
    Bad("prefill-below-k-plus-1", edit(("  prefill_seq_len: 32", "  prefill_seq_len: 3")),
        "shapes.prefill_seq_len", L_PREFILL, "3 is less than K+1 = 4"),
    Bad("prefill-above-ctx", edit(("  prefill_seq_len: 32", "  prefill_seq_len: 512")),
        "shapes.prefill_seq_len", L_PREFILL, "512 is larger than ctx_len 256"),
    Bad("ctx-not-multiple-of-32", edit(("  ctx_len: 256", "  ctx_len: 250")),
        "shapes.ctx_len", L_CTX, "250 is not a multiple of 32"),
    Bad("batch-size-zero", edit(("  batch_size: 1", "  batch_size: 0")),
        "shapes.batch_size", L_BATCH, "got 0"),
    Bad("batch-size-too-large", edit(("  batch_size: 1", "  batch_size: 5000")),
        "shapes.batch_size", L_BATCH, "5000"),
    Bad("full-batch-below-batch", edit(("  batch_size: 1", "  batch_size: 4\n"
                                                          "  full_batch_size: 2")),
        "shapes.full_batch_size", L_BATCH + 1, "2 is smaller than batch_size 4"),
    # ---- cores and devices
    Bad("cores-over-budget-shared-qid", edit(("    num_cores: 6", "    num_cores: 8")),
        "hardware.draft.num_cores", L_D_CORES, "target 10 + draft 8"),
    Bad("num-cores-over-16", edit(("    num_cores: 10", "    num_cores: 17")),
        "hardware.target.num_cores", L_T_CORES, "17 cores exceed the 16"),
    Bad("num-cores-over-14-on-standard", edit(("  card: cloud-ai-100-ultra",
                                               "  card: cloud-ai-100-standard"),
                                              ("    num_cores: 10", "    num_cores: 15")),
        "hardware.target.num_cores", L_T_CORES, "15 cores exceed the 14"),
    Bad("num-cores-zero", edit(("    num_cores: 6", "    num_cores: 0")),
        "hardware.draft.num_cores", L_D_CORES, "got 0"),
    Bad("device-4-on-one-ultra", edit((T_DEVICES, "  target:\n    device_group: [0, 4]")),
        "hardware.target.device_group[1]", L_T_DEVICES, "device 4 is outside"),
    Bad("device-minus-1", edit((D_DEVICES, "  draft:\n    device_group: [-1]")),
        "hardware.draft.device_group[0]", L_D_DEVICES, "device -1 is outside"),
    Bad("duplicate-devices", edit((T_DEVICES, "  target:\n    device_group: [0, 0]")),
        "hardware.target.device_group", L_T_DEVICES, "duplicate device ids in [0, 0]"),
    Bad("empty-device-group", edit((D_DEVICES, "  draft:\n    device_group: []")),
        "hardware.draft.device_group", L_D_DEVICES, "at least 1"),
    # ---- draft and method options
    Bad("draft-model-with-ngram", edit(NGRAM),
        "draft.model", L_DRAFT_MODEL, "method 'ngram' uses no draft model"),
    Bad("draft-model-with-suffix", edit(("  method: draft_model", "  method: suffix")),
        "draft.model", L_DRAFT_MODEL, "method 'suffix' uses no draft model"),
    Bad("draft-revision-with-ngram", edit(NGRAM, (DRAFT_MODEL_LINE, "  revision: main")),
        "draft.revision", L_DRAFT_MODEL, "method 'ngram' uses no draft model"),
    Bad("draft-model-missing", edit((DRAFT_MODEL_LINE, "#")),
        "draft.model", L_DRAFT, "needs a draft model"),
    Bad("p-min-with-ngram", edit(NGRAM, (DRAFT_MODEL_LINE + "\n", "")),
        "speculation.draft_p_min", None, "method 'ngram' has no draft distribution",
        overrides=("speculation.draft_p_min=0.3",)),
    Bad("ngram-min-above-max", edit(NGRAM, (DRAFT_MODEL_LINE, "  prompt_lookup_min: 5\n"
                                                             "  prompt_lookup_max: 2")),
        "draft.prompt_lookup_min", L_DRAFT_MODEL, "5 is larger than prompt_lookup_max 2"),
    Bad("suffix-option-with-ngram", edit(NGRAM, (DRAFT_MODEL_LINE,
                                                 "  suffix_decoding_max_tree_depth: 8")),
        "draft.suffix_decoding_max_tree_depth", L_DRAFT_MODEL, "another method than 'ngram'"),
    Bad("ngram-option-with-draft-model", edit((DRAFT_MODEL_LINE, DRAFT_MODEL_LINE +
                                               "\n  prompt_lookup_max: 3")),
        "draft.prompt_lookup_max", L_DRAFT_MODEL + 1, "another method than 'draft_model'"),
    Bad("suffix-min-token-prob-1.5", edit(("  method: draft_model", "  method: suffix"),
                                          (DRAFT_MODEL_LINE,
                                           "  suffix_decoding_min_token_prob: 1.5")),
        "draft.suffix_decoding_min_token_prob", L_DRAFT_MODEL, "1.5"),
    Bad("unknown-method", edit(("  method: draft_model", "  method: eagle")),
        "draft.method", L_METHOD, "'eagle'"),
    # ---- precision and backends
    # without qaic the card's formats are emulated on ONNX Runtime: in the fused graph only
    Bad("mxint8-kv-on-portable-graph-without-qaic", edit(
        ("  kv_cache_dtype: float16", "  kv_cache_dtype: mxint8"),
        ("backends: [onnxruntime]", "backends: [onnxruntime]\nonnxruntime: {graph: portable}")),
        "precision.kv_cache_dtype", L_KV, "fused graph only"),
    Bad("mxfp6-on-portable-graph-without-qaic", edit(
        ("  quantization: none", "  quantization: mxfp6"),
        ("backends: [onnxruntime]", "backends: [onnxruntime]\nonnxruntime: {graph: portable}")),
        "precision.quantization", L_QUANT, "graph is portable"),
    Bad("unknown-quantization", edit(("  quantization: none", "  quantization: int4")),
        "precision.quantization", L_QUANT, "'int4'"),
    Bad("unknown-backend", edit(("backends: [onnxruntime]", "backends: [onnxruntime, tensorrt]")),
        "backends", L_BACKENDS, "'tensorrt'"),
    Bad("duplicate-backends", edit(("backends: [onnxruntime]", "backends: [qaic, qaic]")),
        "backends", L_BACKENDS, "duplicate backends"),
    Bad("empty-backends", edit(("backends: [onnxruntime]", "backends: []")),
        "backends", L_BACKENDS, "at least 1"),
    # ---- hardware
    Bad("bad-card", edit(("  card: cloud-ai-100-ultra", "  card: cloud-ai-200")),
        "hardware.card", L_CARD, "'cloud-ai-200'"),
    Bad("bad-aic-hw-version", edit(("  aic_hw_version: ai100", "  aic_hw_version: ai300")),
        "hardware.aic_hw_version", L_HW_VERSION, "'ai300'"),
    Bad("bad-specializations-format", edit(("  aic_hw_version: ai100", "  aic_hw_version: ai100\n"
                                            "  specializations_format: nested")),
        "hardware.specializations_format", L_HW_VERSION + 1, "'nested'"),
    Bad("zero-cards", edit(("  aic_hw_version: ai100", "  aic_hw_version: ai100\n"
                            "  num_cards: 0")),
        "hardware.num_cards", L_HW_VERSION + 1, "got 0"),
    # ---- top level
    Bad("schema-2", edit(("schema: 1", "schema: 2")), "schema", L_SCHEMA, "2"),
    Bad("schema-as-string", edit(("schema: 1", 'schema: "1"')), "schema", L_SCHEMA, "'1'"),
    Bad("schema-missing", edit(("schema: 1", "#")), "schema", None, "required key is missing"),
    Bad("name-missing", edit(("name: base-pair", "#")), "name", None, "required key is missing"),
    Bad("name-bad-characters", edit(("name: base-pair", "name: base pair!")),
        "name", L_NAME, "'base pair!'"),
    Bad("name-leading-dot", edit(("name: base-pair", "name: .hidden")),
        "name", L_NAME, "'.hidden'"),
    Bad("target-missing", edit((f"target:\n  model: {TARGET}", "#\n#")),
        "target", None, "required key is missing"),
    Bad("target-model-empty", edit((f"  model: {TARGET}", '  model: ""')),
        "target.model", L_TARGET_MODEL, "at least 1 character"),
    Bad("target-model-null", edit((f"  model: {TARGET}", "  model:")),
        "target.model", L_TARGET_MODEL, "None"),
    Bad("int8-draft-weights-in-the-portable-graph", BASE, "onnxruntime.draft_weights", None,
        "need onnxruntime.graph: fused", ("onnxruntime.draft_weights=int8",
                                          "onnxruntime.graph=portable")),
    Bad("int8-draft-weights-without-a-draft", BASE, "onnxruntime.draft_weights", None,
        "has no draft model", ("onnxruntime.draft_weights=int8", "draft.method=ngram",
                               "draft.model=null")),
    Bad("int4-weights-cannot-hold-mxfp6", BASE, "onnxruntime.draft_weights", None,
        "cannot hold the MXFP6", ("onnxruntime.draft_weights=int4",
                                  "precision.quantization=mxfp6")),
    Bad("weights-format-unknown", BASE, "onnxruntime.target_weights", None, "int4",
        ("onnxruntime.target_weights=int3",)),
    Bad("block-size-for-float32-weights", BASE, "onnxruntime.target_block_size", None,
        "is float32", ("onnxruntime.target_block_size=128",)),
    Bad("block-size-unknown", BASE, "onnxruntime.draft_block_size", None, "128",
        ("onnxruntime.draft_weights=int4", "onnxruntime.draft_block_size=48")),
    Bad("block-size-under-mxfp6", BASE, "onnxruntime.draft_block_size", None, "blocks of 32",
        ("onnxruntime.draft_weights=int8", "onnxruntime.draft_block_size=64",
         "precision.quantization=mxfp6")),
    # ---- --set overrides
    Bad("override-missing-equals", BASE, "shapes.ctx_len", None, "KEY.PATH=VALUE",
        ("shapes.ctx_len",)),
    Bad("override-through-list", BASE, "backends.qaic", None, "'backends' is not a mapping",
        ("backends.qaic=1",)),
    Bad("override-through-int", BASE, "shapes.ctx_len.x", None, "'ctx_len' is not a mapping",
        ("shapes.ctx_len.x=1",)),
    Bad("override-empty-path-part", BASE, "shapes..ctx_len", None, "empty key path",
        ("shapes..ctx_len=512",)),
    Bad("override-unknown-key", BASE, "shapes.ctx", None, "did you mean 'ctx_len'?",
        ("shapes.ctx=512",)),
    Bad("override-bad-value", BASE, "shapes.ctx_len", L_CTX, "100 is not a multiple of 32",
        ("shapes.ctx_len=100",)),
    Bad("override-malformed-value", BASE, "<file>", None, "malformed YAML",
        ("shapes.ctx_len=[1, 2",)),
    # ---- not a recipe at all
    Bad("malformed-yaml", edit(("  ctx_len: 256", "  ctx_len: 256: 3")),
        "<file>", L_CTX, "mapping values are not allowed"),
    Bad("malformed-yaml-tab", edit(("  ctx_len: 256", "\tctx_len: 256")),
        "<file>", L_CTX, "malformed YAML"),
    Bad("malformed-yaml-unclosed-flow", edit(("backends: [onnxruntime]", "backends: [qaic\n"
                                              "output: x")),
        "<file>", L_BACKENDS + 1, "malformed YAML"),
    Bad("two-documents", BASE + "---\nschema: 1\n", "<file>", L_BACKENDS + 1,
        "another document"),
    Bad("empty-text", "", "<file>", None, "empty"),
    Bad("only-comments", "# nothing here\n\n", "<file>", None, "empty"),
    Bad("yaml-list", "- schema: 1\n- name: x\n", "<root>", None, "not a list"),
    Bad("yaml-scalar", "just a sentence\n", "<root>", None, "not a str"),
    Bad("yaml-null", "~\n", "<root>", None, "not a NoneType"),
    Bad("non-string-root-key", "1: one\n" + BASE, "<root>", None, "keys must be strings"),
    Bad("alias-bomb", BILLION_LAUGHS, "<file>", 2, "aliases"),
    Bad("python-tag", "!!python/object/apply:os.system ['echo pwned']\n", "<file>", 1,
        "could not determine a constructor"),
    Bad("nested-too-deep", "[" * 5000, "<file>", None, "nested too deeply"),
    Bad("nul-character", "schema: 1\x00\n", "<file>", None, "special characters"),
    Bad("over-one-mib", BASE + "# " + "x" * MAX_RECIPE_BYTES + "\n", "<file>", None,
        "larger than"),
]


def test_table_is_big_and_ids_unique():
    assert len(BAD) >= 45
    assert len({b.id for b in BAD}) == len(BAD)


def test_base_is_valid_and_lines_are_as_documented():
    r = recipe_from_text(BASE)
    assert r.warnings == []
    for path, line in [("schema", L_SCHEMA), ("name", L_NAME), ("target.model", L_TARGET_MODEL),
                       ("draft", L_DRAFT), ("draft.method", L_METHOD),
                       ("draft.model", L_DRAFT_MODEL),
                       ("speculation.num_speculative_tokens", L_K),
                       ("shapes.batch_size", L_BATCH), ("shapes.prefill_seq_len", L_PREFILL),
                       ("shapes.ctx_len", L_CTX), ("precision.quantization", L_QUANT),
                       ("precision.kv_cache_dtype", L_KV), ("hardware.card", L_CARD),
                       ("hardware.aic_hw_version", L_HW_VERSION),
                       ("hardware.target.device_group", L_T_DEVICES),
                       ("hardware.target.num_cores", L_T_CORES),
                       ("hardware.draft.device_group", L_D_DEVICES),
                       ("hardware.draft.num_cores", L_D_CORES), ("backends", L_BACKENDS)]:
        assert r.line_of(path) == line, path


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_bad_recipe(bad: Bad):
    with pytest.raises(RecipeError) as info:
        recipe_from_text(bad.text, "bad.yaml", overrides=list(bad.overrides))
    assert_problem(info.value, bad.path, bad.line, bad.fragment)
    assert bad.path.split("[")[0].split(".")[0] in str(info.value)


def test_billion_laughs_is_refused_fast():
    # Expanded, the document would hold 9**9 strings; refusing must not expand it.
    assert "*a" in BILLION_LAUGHS and len(BILLION_LAUGHS) < 1000
    with pytest.raises(RecipeError, match="aliases"):
        recipe_from_text(BILLION_LAUGHS)


def test_several_static_errors_are_all_reported():
    text = edit(("  ctx_len: 256", "  ctx_len: 250"),
                (T_DEVICES, "  target:\n    device_group: [0, 4]"),
                ("  kv_cache_dtype: float16", "  kv_cache_dtype: mxint8"),
                ("backends: [onnxruntime]",  # mxint8 on a portable graph
                 "backends: [onnxruntime]\nonnxruntime: {graph: portable}"))
    with pytest.raises(RecipeError) as info:
        recipe_from_text(text)
    exc = info.value
    assert len(exc.problems) == 3, problems_of(exc)
    assert_problem(exc, "shapes.ctx_len", L_CTX, "250")
    assert_problem(exc, "hardware.target.device_group[1]", L_T_DEVICES, "device 4")
    assert_problem(exc, "precision.kv_cache_dtype", L_KV, "mxint8")
    assert "3 problem(s)" in str(exc)


def test_several_schema_errors_are_all_reported():
    text = edit(("  batch_size: 1", "  batch_sise: 1"), ("  ctx_len: 256", "  ctx_len: big"),
                ("  card: cloud-ai-100-ultra", "  card: gpu"))
    with pytest.raises(RecipeError) as info:
        recipe_from_text(text)
    exc = info.value
    assert len(exc.problems) == 3, problems_of(exc)
    assert {p.path for p in exc.problems} == {"shapes.batch_sise", "shapes.ctx_len",
                                              "hardware.card"}
    assert sorted(p.line for p in exc.problems) == [L_BATCH, L_CTX, L_CARD]


def test_valid_variants_are_accepted():
    more_devices = edit((T_DEVICES, "  target:\n    device_group: [4, 5]"),
                        ("  aic_hw_version: ai100", "  aic_hw_version: ai100\n  num_cards: 2"))
    assert recipe_from_text(more_devices).hardware.target.device_group == [4, 5]
    ngram = edit(NGRAM, (DRAFT_MODEL_LINE, "  prompt_lookup_max: 6"))
    r = recipe_from_text(ngram)
    assert r.ks == (0, 3)
    # vLLM's rule: one of the two given -> the other takes its value; neither -> 5 and 5
    assert r.method_options == {"prompt_lookup_min": 6, "prompt_lookup_max": 6}
    only_min = recipe_from_text(edit(NGRAM, (DRAFT_MODEL_LINE, "  prompt_lookup_min: 2")))
    assert only_min.method_options == {"prompt_lookup_min": 2, "prompt_lookup_max": 2}
    assert recipe_from_text(edit(NGRAM, (DRAFT_MODEL_LINE, "#"))).method_options == \
        {"prompt_lookup_min": 5, "prompt_lookup_max": 5}
    separate = edit((D_DEVICES, "  draft:\n    device_group: [1]"), ("    num_cores: 6", "#"),
                    ("    num_cores: 10", "    num_cores: 16"))
    assert recipe_from_text(separate).hardware.target.num_cores == 16
    anchor_only = BASE.replace("backends: [onnxruntime]", "backends: &b [onnxruntime]")
    assert recipe_from_text(anchor_only).backends == ["onnxruntime"]


def test_warnings_are_not_errors():
    r = recipe_from_text(edit(("  aic_hw_version: ai100", "  aic_hw_version: ai200"),
                              ("  kv_cache_dtype: float16", "  kv_cache_dtype: mxint8"),
                              ("backends: [onnxruntime]", "backends: [qaic]")))
    assert [(w.path, w.severity) for w in r.warnings] == [("precision.kv_cache_dtype",
                                                           "warning")]


def test_overrides_apply_in_order_and_parse_yaml_values():
    r = recipe_from_text(BASE, overrides=["shapes.ctx_len=4096", "shapes.full_batch_size=8",
                                          "backends=[qaic, onnxruntime]",
                                          "hardware.draft.num_cores=null",
                                          "hardware.target.num_cores=null"])
    assert r.shapes.ctx_len == 4096 and r.shapes.full_batch_size == 8
    assert r.backends == ["qaic", "onnxruntime"]
    assert r.hardware.target.num_cores is None


# ---------------------------------------------------------------- files
def test_load_recipe_from_file_and_relative_models(tmp_path):
    (tmp_path / "models" / "t").mkdir(parents=True)
    path = tmp_path / "r.yaml"
    path.write_text(BASE.replace(f"model: {TARGET}", "model: ./models/t"))
    r = load_recipe(path)
    assert r.source_dir() == tmp_path.resolve()
    assert resolve_model_path(r, r.target.model) == str((tmp_path / "models" / "t").resolve())
    assert resolve_model_path(r, r.draft.model) == DRAFT


def _file_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    big = tmp_path / "big.yaml"
    big.write_text(BASE + "# " + "x" * MAX_RECIPE_BYTES + "\n")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(BASE.replace("base-pair", "caf\xe9").encode("latin-1"))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01garbage\x80")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    return {"over-one-mib": (big, "larger than"), "latin-1": (latin1, "not UTF-8"),
            "binary": (binary, "not UTF-8"), "folder": (folder, "is a folder"),
            "missing": (tmp_path / "nope.yaml", "no such file")}


@pytest.mark.parametrize("case", ["over-one-mib", "latin-1", "binary", "folder", "missing"])
def test_bad_recipe_files(tmp_path, case):
    path, fragment = _file_cases(tmp_path)[case]
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert_problem(info.value, "<file>", None, fragment)
    assert info.value.source == str(path)


def test_bad_file_with_line_number(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(edit(("  prefill_seq_len: 32", "  prefill_seq_len: 3")))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert_problem(info.value, "shapes.prefill_seq_len", L_PREFILL, "K+1")
    assert f"shapes.prefill_seq_len (line {L_PREFILL})" in str(info.value)


# ---------------------------------------------------------------- CLI
runner = CliRunner()


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, expected", [
    (edit(("  ctx_len: 256", "  ctx_len: 250")), f"shapes.ctx_len (line {L_CTX})"),
    (edit(("    num_cores: 10", "    num_core: 10")), "hardware.target.num_core"),
    (edit(("    num_cores: 6", "    num_cores: 8")), "hardware.draft.num_cores"),
    (edit(("  ctx_len: 256", "  ctx_len: 256: 3")), f"<file> (line {L_CTX})"),
    (edit((f"  model: {TARGET}", "  model: no-such-org/no-such-model")), "target.model"),
], ids=["ctx-len", "unknown-key", "core-budget", "malformed", "unknown-model"])
def test_cli_plan_bad_recipe_exits_2(tmp_path, text, expected):
    result = runner.invoke(app, ["plan", _write(tmp_path, text)])
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert "Traceback" not in result.output


def test_cli_plan_missing_file_and_bad_override(tmp_path):
    result = runner.invoke(app, ["plan", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 2 and "no such file" in result.output
    result = runner.invoke(app, ["plan", _write(tmp_path, BASE), "--set", "shapes.ctx_len"])
    assert result.exit_code == 2 and "KEY.PATH=VALUE" in result.output


def _needs_missing_local_model(path: Path) -> str | None:
    r = load_recipe(path)
    refs = [r.target.model] + ([r.draft.model] if r.draft.model else [])
    for ref in refs:
        if ref.startswith((".", "/", "~")) and not Path(resolve_model_path(r, ref)).is_dir():
            return ref
    return None


def _on_real_models(path: Path) -> pytest.ParameterSet:
    """A shipped recipe as a test parameter, marked real_model where it names a local model
    folder that `make smollm2` / `make qwen-coder` fetch (only models/demo is committed)."""
    r = load_recipe(path)
    refs = [r.target.model] + ([r.draft.model] if r.draft.model else [])
    real = any(ref.startswith((".", "/", "~")) and "models/demo" not in ref for ref in refs)
    return pytest.param(path, id=path.name, marks=[pytest.mark.real_model] if real else [])


@pytest.mark.parametrize("path", [_on_real_models(p) for p in RECIPES])
def test_cli_plan_json_on_shipped_recipes(path):
    missing = _needs_missing_local_model(path)
    if missing:
        pytest.skip(f"{missing} is not built yet (scripts/train_demo_pair.py writes it)")
    result = runner.invoke(app, ["plan", "--json", str(path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["recipe"]["name"] == load_recipe(path).name
    assert "target" in doc["roles"]


def test_shipped_recipes_exist():
    assert {"llama8b-1b.yaml", "llama8b-ngram.yaml"} <= {p.name for p in RECIPES}


def test_cli_set_changes_the_plan():
    path = str(ROOT / "recipes" / "llama8b-1b.yaml")
    base = json.loads(runner.invoke(app, ["plan", "--json", path]).stdout)
    result = runner.invoke(app, ["plan", "--json", path, "--set", "shapes.ctx_len=4096"])
    assert result.exit_code == 0, result.output
    changed = json.loads(result.stdout)
    assert base["recipe"]["shapes"]["ctx_len"] == 2048
    assert changed["recipe"]["shapes"]["ctx_len"] == 4096
    for role in ("target", "draft"):
        assert {s["symbols"]["ctx_len"] for s in changed["roles"][role]["specializations"]} \
            == {"4096"}
        assert changed["roles"][role]["memory"]["kv_cache_gib"] == \
            pytest.approx(2 * base["roles"][role]["memory"]["kv_cache_gib"])


def test_cli_resolved_prints_yaml_with_defaults():
    result = runner.invoke(app, ["plan", "--resolved", str(ROOT / "recipes" / "llama8b-1b.yaml")])
    assert result.exit_code == 0, result.output
    doc = yaml.safe_load(result.stdout)
    assert doc["schema"] == 1 and doc["name"] == "llama3.1-8b-instruct-spd-llama3.2-1b"
    assert doc["shapes"]["full_batch_size"] is None
    assert doc["precision"]["export_dtype"] == "float32"
    assert doc["hardware"]["num_cards"] == 1
    assert doc["hardware"]["specializations_format"] == "named"
    assert doc["hardware"]["compiler_options"]["mos"] is None
    assert doc["onnxruntime"] == {"graph": "fused", "intra_op_threads": None,
                                  "draft_weights": "float32", "target_weights": "float32",
                                  "draft_block_size": None, "target_block_size": None}
    assert doc["draft"]["trust_remote_code"] is False
    # What --resolved prints is itself a valid recipe that resolves to the same thing.
    assert recipe_from_text(result.stdout).to_yaml_dict() == doc


# ---------------------------------------------------------------- property-based
KNOWN_KEYS = sorted({"schema", "name", "target", "draft", "speculation", "shapes", "precision",
                     "hardware", "backends", "onnxruntime", "output", "model", "method",
                     "num_speculative_tokens", "batch_size", "ctx_len", "prefill_seq_len",
                     "device_group", "num_cores", "card", "compiler_options", "extra_flags"})
WEIRD_TEXT = st.text(max_size=12) | st.sampled_from(
    ["", " ", "~", "<<", "?", "- x", "a.b", "[0]", "*x", "&y", "!!str", "\u200b", "é", "\n"])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-3, 40)
           | st.floats(allow_nan=True, allow_infinity=True) | WEIRD_TEXT
           | st.sampled_from(["ngram", "suffix", "draft_model", "qaic", "mxint8", "mxfp6",
                              TARGET, DRAFT]))
KEYS = WEIRD_TEXT | st.sampled_from(KNOWN_KEYS) | st.integers() | st.none() | st.booleans()
DOCS = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                    | st.dictionaries(KEYS, children, max_size=5), max_leaves=25)
ROOTS = DOCS | st.dictionaries(st.sampled_from(KNOWN_KEYS), DOCS, max_size=8)
PROPS = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _only_recipe_errors(text: str, overrides=()) -> None:
    try:
        r = recipe_from_text(text, overrides=overrides)
    except RecipeError as exc:
        assert exc.problems
        assert all(isinstance(p.path, str) and p.message for p in exc.problems)
        str(exc)
    else:
        assert isinstance(r, Recipe)
        r.to_yaml_dict()


@PROPS
@given(ROOTS)
def test_random_documents_give_only_recipe_errors(doc):
    _only_recipe_errors(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))


VALID = yaml.safe_load(BASE)
VALID["shapes"]["full_batch_size"] = 4
VALID["hardware"]["compiler_options"] = {"aic_enable_depth_first": True, "extra_flags": ["-x"]}
VALID["onnxruntime"] = {"graph": "portable"}
VALID["output"] = "build/x"


def _paths(node, prefix=()):
    """Every (container path, key) pair of a nested dict/list document."""
    items = node.items() if isinstance(node, dict) else \
        enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield prefix, key
        yield from _paths(value, prefix + (key,))


def _at(doc, path):
    for part in path:
        doc = doc[part]
    return doc


@PROPS
@given(st.data())
def test_mutated_valid_recipe_gives_only_recipe_errors(data):
    doc = copy.deepcopy(VALID)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = list(_paths(doc))
        if not paths:
            break
        parent_path, key = data.draw(st.sampled_from(paths), label="where")
        parent = _at(doc, parent_path)
        kind = data.draw(st.sampled_from(["delete", "replace", "rename"]), label="kind")
        if kind == "delete":
            del parent[key]
        elif kind == "replace":
            parent[key] = data.draw(DOCS, label="value")
        elif isinstance(parent, dict):
            new_key = data.draw(KEYS, label="new key")
            parent[new_key] = parent.pop(key)
    overrides = data.draw(st.lists(st.sampled_from(
        ["shapes.ctx_len=512", "draft.method=ngram", "backends=[qaic]", "x.y=1", "name",
         "shapes.batch_size.x=2", "hardware.target.num_cores=null"]), max_size=2),
        label="overrides")
    _only_recipe_errors(yaml.safe_dump(doc, sort_keys=False), overrides)


@PROPS
@given(st.binary(max_size=300) | st.text(max_size=300)
       | st.lists(st.sampled_from(["schema: 1\n", "name: x\n", "target:\n", "  model: m\n",
                                   "draft: {method: ngram}\n", "- ", "[", "]", "{", "}", ": ",
                                   "&a ", "*a ", "!!binary ", "\t", "'", '"', "#", "\n", "---\n",
                                   "? ", "%YAML 1.1\n", "\x00", "\ufeff"]),
                  max_size=30).map("".join))
def test_random_text_gives_only_recipe_errors(raw):
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    try:
        recipe_from_text(text)
    except RecipeError as exc:
        assert exc.problems
    # Some short texts are valid recipes ("schema: 1\nname: x\ntarget:\n  model: m\n..."): fine.


def test_typed_changes_equal_the_set_assignments_a_user_would_type():
    """Stages hand recipe changes to each other as one typed value (per section, its fields),
    never as --set strings; applied with with_changes, they give the recipe the same
    assignments typed by a user give."""
    from qpcbuild.measuring import shown
    from qpcbuild.recipe import RecipeChanges, with_changes

    path = Path(__file__).resolve().parent.parent / "recipes" / "demo.yaml"
    changes = RecipeChanges(backends=("onnxruntime",),
                            shapes={"batch_size": 2, "full_batch_size": None},
                            speculation={"num_speculative_tokens": [0, 1, 3]})
    assert shown(changes) == ("backends=[onnxruntime], speculation.num_speculative_tokens=[0,1,3], "
                              "shapes.batch_size=2, shapes.full_batch_size=null")
    typed = load_recipe(path, [], changes)
    typed_by_user = load_recipe(path, shown(changes).split(", "))
    assert typed.model_dump() == typed_by_user.model_dump()
    assert typed.shapes.batch_size == 2 and typed.ks == (0, 1, 3)
    # the changed recipe still resolves its models from the recipe's folder
    assert typed.source_dir() == path.parent and typed.source == str(path)
    # later changes win, field by field
    later = changes.then(RecipeChanges(shapes={"batch_size": 4}))
    assert later.shapes == {"batch_size": 4, "full_batch_size": None}
    assert later.backends == ("onnxruntime",)
    # validated like the rest of the recipe: a field's own rule, and a cross-field rule
    original = load_recipe(path)
    with pytest.raises(RecipeError, match="batch_size"):
        with_changes(original, RecipeChanges(shapes={"batch_size": 0}))
    with pytest.raises(RecipeError, match="prefill_seq_len") as info:
        with_changes(original, RecipeChanges(shapes={"prefill_seq_len": 2}))
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="has no field batch_sise"):  # a programming error
        RecipeChanges(shapes={"batch_sise": 2})

"""Recipe: the one YAML file a user writes. Schema, loading with line numbers, static checks.

Loading never trusts the file (recipe_file.py reads it), validates it against a strict schema
and reports every problem at once with its key path and line. Checks that need model configs
live in `plan`.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from .errors import Problem, RecipeError, UsageError
from .recipe_file import dotted, parse_yaml, read_capped

MAX_K = 32
MAX_CTX_LEN = 1 << 20  # beyond any released model's context; a model's own limit is checked too
CTX_LEN_MULTIPLE = 32

# Cards we know: QIDs (SoCs) per card, NSP cores per QID, on-board DRAM per QID in GiB.
# Source: Qualcomm Cloud AI 100 product briefs (Ultra: 4 SoCs, 64 cores, 128 GB;
# Pro: 1 SoC, 16 cores, 32 GB; Standard: 1 SoC, 14 cores, 16 GB).
CARDS: dict[str, dict[str, int]] = {
    "cloud-ai-100-ultra": {"qids": 4, "cores_per_qid": 16, "dram_gib_per_qid": 32},
    "cloud-ai-100-pro": {"qids": 1, "cores_per_qid": 16, "dram_gib_per_qid": 32},
    "cloud-ai-100-standard": {"qids": 1, "cores_per_qid": 14, "dram_gib_per_qid": 16},
}

# Published per-card figures for `tune --cost-model`, divided per QID (SoC): DDR bandwidth and
# fp16 compute. Source: the Cloud AI SDK documentation, "Architecture", table of SKUs
# (https://quic.github.io/cloud-ai-sdk-pages/latest/Getting-Started/Architecture): DDR BW
# Standard 137 GB/s, Pro 137 GB/s, Ultra 548 GB/s (4 SoCs); FP16 110 / 125 / 290 TFLOPs. These
# are AI 100 figures; an ai200 card has none here (give --card-bandwidth-gbs and --card-tflops).
CARD_ROOFLINE_SOURCE = ("Qualcomm Cloud AI SDK documentation, Getting-Started/Architecture, "
                        "table of SKUs")
CARD_ROOFLINE: dict[str, dict[str, float]] = {
    "cloud-ai-100-ultra": {"dram_gbs_per_qid": 548 / 4, "fp16_tflops_per_qid": 290 / 4},
    "cloud-ai-100-pro": {"dram_gbs_per_qid": 137.0, "fp16_tflops_per_qid": 125.0},
    "cloud-ai-100-standard": {"dram_gbs_per_qid": 137.0, "fp16_tflops_per_qid": 110.0},
}

Method = Literal["draft_model", "ngram", "suffix"]
Backend = Literal["onnxruntime", "qaic"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelRef(_Strict):
    model: str = Field(min_length=1)
    revision: str | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False  # .bin/.pt checkpoints execute code on load: opt in only
    allow_unused_weights: bool = False  # tensors config.json does not describe: opt in only


class Draft(_Strict):
    method: Method = "draft_model"
    model: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False
    allow_unused_weights: bool = False
    # A JSON file {"token_ids": [...]} (relative to the recipe): the draft's LM head keeps only
    # these rows, so a call reads less; it proposes only these tokens, never changing the output.
    vocab_subset: str | None = Field(default=None, min_length=1)
    # ngram (vLLM names and defaults)
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    # suffix (vLLM names and defaults)
    suffix_decoding_max_tree_depth: int | None = Field(default=None, ge=1)
    suffix_decoding_max_cached_requests: int | None = Field(default=None, ge=0)
    suffix_decoding_max_spec_factor: float | None = Field(default=None, gt=0)
    suffix_decoding_min_token_prob: float | None = Field(default=None, ge=0, le=1)


# vLLM's: both 5 when neither is given, one given -> the other takes its value (method_options)
NGRAM_DEFAULTS = {"prompt_lookup_min": 5, "prompt_lookup_max": 5}
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}


VLLM_NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min/max when neither is given


def vllm_lookup_range(lo: int | None, hi: int | None) -> tuple[int, int]:
    """vLLM's resolution of prompt_lookup_min/max: neither given -> 5 and 5; one given -> the
    other takes its value."""
    if lo is None and hi is None:
        return VLLM_NGRAM_DEFAULT, VLLM_NGRAM_DEFAULT
    return (hi if lo is None else lo), (lo if hi is None else hi)


class Speculation(_Strict):
    num_speculative_tokens: Union[int, list[int]] = 3
    # auto: speculate only while it is faster than decoding without (docs/adaptive.md; the
    # plan compiles K=0 for it); fixed: always; off: never
    policy: Literal["auto", "fixed", "off"] = "fixed"
    # draft_model: a row stops proposing when the draft's top probability is below this
    # (llama.cpp's --draft-p-min); 0 = never
    draft_p_min: float = Field(default=0.0, ge=0, le=1)
    # K per number of live rows, {batch size: K} (`tune --per-batch`); compiled with the Ks
    num_speculative_tokens_per_batch_size: dict[int, int] | None = None


class Shapes(_Strict):
    batch_size: int = Field(default=1, ge=1, le=1024)
    full_batch_size: int | None = Field(default=None, ge=1, le=1024)
    prefill_seq_len: int = Field(default=32, ge=1, le=MAX_CTX_LEN)
    ctx_len: int = Field(default=128, ge=1, le=MAX_CTX_LEN)


class Precision(_Strict):
    quantization: Literal["none", "mxfp6"] = "none"
    kv_cache_dtype: Literal["float16", "mxint8"] = "float16"
    export_dtype: Literal["float32", "float16"] = "float32"


class RoleHardware(_Strict):
    device_group: list[int] = Field(default_factory=lambda: [0], min_length=1)
    num_cores: int | None = Field(default=None, ge=1)


class CompilerOptions(_Strict):
    aic_enable_depth_first: bool = False
    mos: int | None = Field(default=None, ge=1)
    allow_mxint8_mdp_io: bool = False
    extra_flags: list[str] = Field(default_factory=list)


class Hardware(_Strict):
    card: Literal["cloud-ai-100-ultra", "cloud-ai-100-pro", "cloud-ai-100-standard"] = \
        "cloud-ai-100-ultra"
    num_cards: int = Field(default=1, ge=1, le=16)
    aic_hw_version: Literal["ai100", "ai200"] = "ai100"
    target: RoleHardware = Field(default_factory=RoleHardware)
    draft: RoleHardware = Field(default_factory=RoleHardware)
    compiler_options: CompilerOptions = Field(default_factory=CompilerOptions)
    specializations_format: Literal["named", "flat"] = "named"


WeightFormat = Literal["float32", "int8", "int4"]


class OrtOptions(_Strict):
    graph: Literal["fused", "portable"] = "fused"  # fused: ORT's GQA kernels; portable: as exported
    intra_op_threads: int | None = Field(default=None, ge=1)  # None: from the core split
    # Each role's matmul weights on ONNX Runtime: float32, or 8-/4-bit blocks of 32 along K
    # (com.microsoft.MatMulNBits, int8 activations). A draft's numerics change only which tokens
    # it proposes, never the output, so a smaller draft trades acceptance for speed; a quantized
    # *target* changes the output itself: opt-in, labelled in run/bench/manifest output, and
    # measured against the float32 target by `bench --numerics`.
    draft_weights: WeightFormat = "float32"
    target_weights: WeightFormat = "float32"


class Recipe(_Strict):
    schema_: Literal[1] = Field(alias="schema")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    target: ModelRef
    draft: Draft = Field(default_factory=Draft)
    speculation: Speculation = Field(default_factory=Speculation)
    shapes: Shapes = Field(default_factory=Shapes)
    precision: Precision = Field(default_factory=Precision)
    hardware: Hardware = Field(default_factory=Hardware)
    backends: list[Backend] = Field(default_factory=lambda: ["onnxruntime"], min_length=1)
    onnxruntime: OrtOptions = Field(default_factory=OrtOptions)
    output: str | None = None

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)
    _source_dir: Path | None = PrivateAttr(default=None)
    _source: str = PrivateAttr(default="<recipe>")  # the file, for messages
    _warnings: list = PrivateAttr(default_factory=list)
    _lines: dict = PrivateAttr(default_factory=dict)

    # ----- resolved views (one place decides each default) -----
    @property
    def ks(self) -> tuple[int, ...]:
        """Compiled speculative lengths, ascending. ngram/suffix get [0, K] unless a list is given."""
        k = self.speculation.num_speculative_tokens
        if isinstance(k, list):
            return tuple(sorted(set(k)))
        if self.draft.method != "draft_model" and k > 0:
            return (0, k)
        return (k,)

    @property
    def compiled_ks(self) -> tuple[int, ...]:
        """What the target is compiled for: `ks`, plus K=0 for policy auto and the Ks of the
        per-batch-size schedule."""
        sp = self.speculation
        extra = {0} if sp.policy == "auto" else set()
        extra |= set((sp.num_speculative_tokens_per_batch_size or {}).values())
        return tuple(sorted(set(self.ks) | extra))

    @property
    def method_options(self) -> dict[str, Any]:
        if self.draft.method == "ngram":
            lo, hi = vllm_lookup_range(self.draft.prompt_lookup_min, self.draft.prompt_lookup_max)
            return {"prompt_lookup_min": lo, "prompt_lookup_max": hi}
        defaults = {"suffix": SUFFIX_DEFAULTS}.get(self.draft.method, {})
        return {key: getattr(self.draft, key) if getattr(self.draft, key) is not None else value
                for key, value in defaults.items()}

    @property
    def source(self) -> str:
        return self._source

    def source_dir(self) -> Path:
        return self._source_dir or Path.cwd()

    @property
    def warnings(self) -> list[Problem]:
        return list(self._warnings)

    def line_of(self, path: str) -> int | None:
        loc = tuple(int(p) if p.isdigit() else p for p in re.split(r"\.|\[|\]\.?", path) if p)
        return next((self._lines[loc[:i]] for i in range(len(loc), -1, -1)
                     if loc[:i] in self._lines), None)

    def output_dir(self) -> Path:
        out = Path(self.output or f"build/{self.name}")
        return out if out.is_absolute() else Path.cwd() / out

    def to_yaml_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


# ---------------------------------------------------------------- validation
def _allowed_keys(loc: tuple) -> list[str]:
    cls: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = next((f for n, f in cls.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann] + list(get_args(ann)) if get_origin(ann) else [ann]
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cls is None:
            return []
    return [f.alias or n for n, f in cls.model_fields.items()]


def _schema_problems(exc: ValidationError, lines: dict[tuple, int]) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and
                                                  p in ("int", "list[int]", "function-after")))
        line = next((lines[loc[:i]] for i in range(len(loc), -1, -1) if loc[:i] in lines), None)
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            guess = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean '{guess[0]}'?" if guess else ""
            msg = f"unknown key '{loc[-1]}'{hint} (allowed: {', '.join(allowed)})"
        elif err["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = f"{err['msg']} (got {err.get('input')!r})"
        problems.append(Problem(dotted(loc), msg, line))
    return problems


def static_problems(r: Recipe) -> list[Problem]:
    """Cross-field rules that need no model files."""
    out: list[Problem] = []

    def add(path: str, msg: str, severity: str = "error") -> None:
        out.append(Problem(path, msg, r.line_of(path), severity))

    k = r.speculation.num_speculative_tokens
    ks = k if isinstance(k, list) else [k]
    if not ks:
        add("speculation.num_speculative_tokens", "empty list; give K or a list such as [0, 3]")
    for i, v in enumerate(ks):
        if isinstance(v, bool) or v < 0 or v > MAX_K:
            add("speculation.num_speculative_tokens", f"K={v} is outside 0..{MAX_K}")
    if isinstance(k, list) and len(set(k)) != len(k):
        add("speculation.num_speculative_tokens", f"duplicate values in {k}")
    if r.draft.method == "draft_model" and ks and max(ks) == 0:
        add("speculation.num_speculative_tokens", "draft_model needs K >= 1")
    for b, kb in (r.speculation.num_speculative_tokens_per_batch_size or {}).items():
        if b < 1 or not 0 <= kb <= MAX_K:
            add("speculation.num_speculative_tokens_per_batch_size", f"{b}: {kb}: batch sizes "
                f"must be >= 1 and Ks in 0..{MAX_K}")
    if r.speculation.draft_p_min and r.draft.method != "draft_model":
        add("speculation.draft_p_min", f"method '{r.draft.method}' has no draft model to be "
            "confident; remove this key")
    s = r.shapes
    kmax = max(ks + list((r.speculation.num_speculative_tokens_per_batch_size or {}).values())
               or [0])
    if s.prefill_seq_len < kmax + 1:
        add("shapes.prefill_seq_len", f"{s.prefill_seq_len} is less than K+1 = {kmax + 1}; the "
            "target's prefill specialization must hold a whole verify window")
    if s.prefill_seq_len > s.ctx_len:
        add("shapes.prefill_seq_len", f"{s.prefill_seq_len} is larger than ctx_len {s.ctx_len}")
    if s.ctx_len % CTX_LEN_MULTIPLE:
        add("shapes.ctx_len", f"{s.ctx_len} is not a multiple of {CTX_LEN_MULTIPLE} (see docs/recipe.md, "
            "'ctx_len rule')")
    if s.full_batch_size is not None and s.full_batch_size < s.batch_size:
        add("shapes.full_batch_size", f"{s.full_batch_size} is smaller than batch_size {s.batch_size}")

    d = r.draft
    if d.method == "draft_model" and not d.model:
        add("draft.model", "draft_model needs a draft model (Hugging Face id or local folder)")
    if d.method != "draft_model":
        for key in ("model", "revision", "vocab_subset"):
            if getattr(d, key) is not None:
                add(f"draft.{key}", f"method '{d.method}' uses no draft model; remove this key")
    own = {"ngram": NGRAM_DEFAULTS, "suffix": SUFFIX_DEFAULTS}.get(d.method, {})
    for key in list(NGRAM_DEFAULTS) + list(SUFFIX_DEFAULTS):
        if getattr(d, key) is not None and key not in own:
            add(f"draft.{key}", f"option belongs to another method than '{d.method}'")
    if d.method == "ngram":
        lo, hi = r.method_options["prompt_lookup_min"], r.method_options["prompt_lookup_max"]
        if lo > hi:
            add("draft.prompt_lookup_min", f"{lo} is larger than prompt_lookup_max {hi}")

    p, h = r.precision, r.hardware
    # Without qaic the card's formats are emulated on ONNX Runtime (the numerics preview),
    # which only the fused graph does; next to qaic a portable ORT graph stays exact (a plan
    # warning says so).
    portable = [why for why, on in (
        (f"shapes.batch_size is {s.batch_size}", s.batch_size > 1),
        ("shapes.full_batch_size is set", s.full_batch_size is not None),
        ("onnxruntime.graph is portable", r.onnxruntime.graph == "portable")) if on]
    if "qaic" not in r.backends and portable:
        for key, fmt, off in (("precision.kv_cache_dtype", "mxint8", "float16"),
                              ("precision.quantization", "mxfp6", "none")):
            if getattr(p, key.split(".")[1]) == fmt:
                add(key, f"{fmt} is emulated on ONNX Runtime in the fused graph only (batch_size "
                    f"1, no full_batch_size, onnxruntime.graph: fused), but {portable[0]}; "
                    f"use the fused graph, add qaic to backends (the card), or use {off}")
    if p.kv_cache_dtype == "mxint8" and h.aic_hw_version != "ai100":
        add("precision.kv_cache_dtype", f"mxint8 KV is only known to work on ai100, not "
            f"{h.aic_hw_version}", "warning")
    if len(r.backends) != len(set(r.backends)):
        add("backends", f"duplicate backends in {r.backends}")
    for role in ("draft", "target"):
        key, fmt = f"onnxruntime.{role}_weights", getattr(r.onnxruntime, f"{role}_weights")
        if fmt == "float32":
            continue
        if role == "draft" and d.method != "draft_model":
            add(key, f"method '{d.method}' has no draft model")
        elif r.shapes.batch_size > 1 or r.shapes.full_batch_size is not None:
            add(key, f"{fmt} {role} weights exist in the fused graph only, which serves "
                "batch_size 1 without full_batch_size")
        elif r.onnxruntime.graph != "fused":
            add(key, f"{fmt} {role} weights need onnxruntime.graph: fused")
        elif fmt == "int4" and p.quantization == "mxfp6":
            add(key, "int4 blocks cannot hold the MXFP6 values precision.quantization: mxfp6 "
                "emulates; use int8 (exact) or float32")

    card = CARDS[h.card]
    n_qids = card["qids"] * h.num_cards
    roles = [("target", h.target)] + ([("draft", h.draft)] if d.method == "draft_model" else [])
    for role, hw in roles:
        if len(set(hw.device_group)) != len(hw.device_group):
            add(f"hardware.{role}.device_group", f"duplicate device ids in {hw.device_group}")
        for i, qid in enumerate(hw.device_group):
            if qid < 0 or qid >= n_qids:
                add(f"hardware.{role}.device_group[{i}]", f"device {qid} is outside the "
                    f"{n_qids} QIDs of {h.num_cards} x {h.card} (0..{n_qids - 1})")
        if hw.num_cores is not None and hw.num_cores > card["cores_per_qid"]:
            add(f"hardware.{role}.num_cores", f"{hw.num_cores} cores exceed the "
                f"{card['cores_per_qid']} per QID of {h.card}")
    if d.method == "draft_model":
        shared = set(h.target.device_group) & set(h.draft.device_group)
        cores = resolved_cores(r)
        if shared and cores["target"] + cores["draft"] > card["cores_per_qid"]:
            add("hardware.draft.num_cores", f"target {cores['target']} + draft {cores['draft']} "
                f"cores exceed the {card['cores_per_qid']} cores of shared QID(s) {sorted(shared)}")
    elif r.hardware.draft != RoleHardware():
        add("hardware.draft", f"method '{d.method}' has no draft model to place", "warning")
    return out


def resolved_cores(r: Recipe) -> dict[str, int]:
    """Cores per QID for each role. Shared QIDs with no explicit split: half each (8/8)."""
    per_qid = CARDS[r.hardware.card]["cores_per_qid"]
    t, d = r.hardware.target, r.hardware.draft
    if r.draft.method != "draft_model":
        return {"target": t.num_cores or per_qid}
    shared = bool(set(t.device_group) & set(d.device_group))
    if not shared:
        return {"target": t.num_cores or per_qid, "draft": d.num_cores or per_qid}
    if t.num_cores is None and d.num_cores is None:
        return {"target": per_qid // 2, "draft": per_qid - per_qid // 2}
    if t.num_cores is None:
        return {"target": max(1, per_qid - d.num_cores), "draft": d.num_cores}
    if d.num_cores is None:
        return {"target": t.num_cores, "draft": max(1, per_qid - t.num_cores)}
    return {"target": t.num_cores, "draft": d.num_cores}


# ---------------------------------------------------------------- overrides and entry point
# A stage's changes to a recipe (measuring at batch 1, another K list, ...): {dotted key: value},
# the values as the recipe file would hold them once read (1, None, ["onnxruntime"]). They are
# applied after the user's --set overrides and validated with the rest of the recipe.
RecipeChanges = Mapping[str, Any]


def apply_override(data: dict, assignment: str) -> None:
    """`--set shapes.ctx_len=4096`: the value is parsed as a YAML scalar or flow sequence."""
    if "=" not in assignment:
        raise RecipeError("--set", [Problem(assignment, "expected KEY.PATH=VALUE")])
    key, raw = assignment.split("=", 1)
    value, _ = parse_yaml(raw or '""', f"--set {key}")
    _set_key(data, key, value)


def _set_key(data: dict, key: str, value: Any) -> None:
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError("--set", [Problem(key, "empty key path")])
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError("--set", [Problem(key, f"'{part}' is not a mapping")])
        node = child
    node[parts[-1]] = value


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                changes: RecipeChanges | None = None) -> Recipe:
    """Read, validate and resolve a recipe (with the user's --set `overrides`, then a stage's
    `changes`); raises RecipeError listing every problem."""
    path = Path(path)
    source = str(path)
    raw = read_capped(path, source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(source, [Problem("<file>", f"not UTF-8 text ({exc.reason} at byte "
                                           f"{exc.start})")]) from None
    return recipe_from_text(text, source, overrides, base_dir=path.resolve().parent,
                            changes=changes)


def _without(data: dict, locs: list[tuple]) -> dict:
    """A copy of data with the keys at `locs` removed, so defaults stand in for bad values."""
    out = copy.deepcopy(data)
    for loc in locs:
        node: Any = out
        for part in loc[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(loc[-1], None)
    return out


def _cross_field_problems(data: dict, exc: ValidationError, lines) -> list[Problem]:
    """Cross-field problems of the rest of the recipe, found with the invalid keys taken out,
    so that one run reports schema and cross-field problems together."""
    bad = [tuple(p for p in e["loc"] if isinstance(p, (str, int)) and p not in
                 ("int", "list[int]", "function-after")) for e in exc.errors()]
    if any(e["type"] == "missing" for e in exc.errors()):
        return []
    try:
        rest = Recipe.model_validate(_without(data, [b for b in bad if b]))
    except (ValidationError, TypeError, ValueError, RecursionError):
        return []
    rest._lines = lines
    flagged = {dotted(b) for b in bad}
    return [p for p in static_problems(rest) if p.severity == "error"
            and not any(p.path.startswith(f) or f.startswith(p.path) for f in flagged)]


def _missing_model_folders(data: dict, base_dir: Path | None, lines) -> list[Problem]:
    """Model folders named by a path that are not there, reported with the recipe's other
    problems (planning would find them only once those are fixed). Hub ids are left to it."""
    out = []
    for role in ("target", "draft"):
        ref = data.get(role, {}).get("model") if isinstance(data.get(role), dict) else None
        if not isinstance(ref, str) or not ref.startswith((".", "/", "~")):
            continue
        try:
            folder = (base_dir or Path.cwd()) / Path(ref).expanduser()
            present = folder.is_dir()
        except (OSError, RuntimeError):
            present = False
        if not present:
            out.append(Problem(f"{role}.model", f"model folder '{ref}' does not exist or is not "
                               "a folder", lines.get((role, "model"))))
    return out


def recipe_from_text(text: str, source: str = "<recipe>", overrides=(),
                     base_dir: Path | None = None, changes: RecipeChanges | None = None
                     ) -> Recipe:
    duplicates: list[Problem] = []
    data, lines = parse_yaml(text, source, duplicates)
    if not isinstance(data, dict):
        raise RecipeError(source, [Problem("<root>", f"a recipe is a mapping of keys "
                                           f"(schema, name, target, ...), not a {type(data).__name__}")])
    if any(not isinstance(key, str) for key in data):
        raise RecipeError(source, [Problem("<root>", "keys must be strings")])
    for assignment in overrides:
        apply_override(data, assignment)
    for key, value in (changes or {}).items():
        _set_key(data, key, copy.deepcopy(value))
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(source, duplicates + _schema_problems(exc, lines)
                          + _cross_field_problems(data, exc, lines)
                          + _missing_model_folders(data, base_dir, lines)) from None
    except (TypeError, ValueError, RecursionError) as exc:  # e.g. unhashable keys deep inside
        raise RecipeError(source, [Problem("<root>", f"cannot read recipe: {exc}")]) from None
    recipe._lines = lines
    problems = static_problems(recipe)
    errors = duplicates + [p for p in problems if p.severity == "error"]
    if errors:
        raise RecipeError(source, errors + _missing_model_folders(data, base_dir, lines))
    recipe._source_dir = base_dir or Path.cwd()
    recipe._source = source
    recipe._warnings = [p for p in problems if p.severity == "warning"]
    return recipe


def recipe_relative(recipe: Recipe, ref: str) -> Path:
    """`ref` as a path: `~` expanded, a relative one taken from the recipe's folder. Raises
    RuntimeError for "~nosuchuser/..." (callers turn it into their own UsageError)."""
    path = Path(ref).expanduser()
    return path if path.is_absolute() else recipe.source_dir() / path


def resolve_model_path(recipe: Recipe, ref: str) -> str:
    """A local folder is taken relative to the recipe's folder; anything else is a hub id."""
    try:
        candidate = recipe_relative(recipe, ref)
        if candidate.exists() or ref.startswith((".", "/", "~")):
            return str(candidate.resolve())
    except (OSError, RuntimeError) as exc:  # "~nosuchuser/m", a name longer than NAME_MAX
        raise UsageError(f"model '{ref}' is neither a usable folder path nor a Hugging Face id "
                         f"({exc})") from None
    return ref

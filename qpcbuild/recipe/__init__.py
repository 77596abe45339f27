"""Recipe: the one YAML file a user writes. Loading with line numbers, static checks, paths
(the schema is recipe/schema.py; its names are importable from here too).

Loading never trusts the file (recipe/file.py reads it), validates it against a strict schema
and reports every problem at once with its key path and line. Checks that need model configs
live in `plan`.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from ..errors import Problem, RecipeError, UsageError
from .changes import RecipeChanges
from .file import KeyPath, dotted, parse_yaml, read_capped
from .placement import Add, _placement, resolved_cores  # noqa: F401  (as before)
from .schema import (  # noqa: F401  (the schema's names, for recipe's importers)
    MAX_K, MAX_CTX_LEN, CTX_LEN_MULTIPLE, CARDS, CARD_ROOFLINE_SOURCE, CARD_ROOFLINE, Method,
    METHODS, CONFIDENT_METHODS, Backend, ModelRef, Draft, NGRAM_DEFAULTS, SUFFIX_DEFAULTS,
    VLLM_NGRAM_DEFAULT, vllm_lookup_range, Speculation, Shapes, Precision, RoleHardware,
    CompilerOptions, Hardware, WeightFormat, OrtOptions, Recipe, Disaggregated, NodeHardware,
    DecodeNode)


# ---------------------------------------------------------------- validation
def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
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


def _schema_problems(exc: ValidationError, lines: dict[KeyPath, int]) -> list[Problem]:
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

    for check in (_speculation_and_shapes, _draft_options, _numerics_options, _placement):
        check(r, add)
    return out


def _speculation_and_shapes(r: Recipe, add: Add) -> None:
    k = r.speculation.num_speculative_tokens
    ks = k if isinstance(k, list) else [k]
    if not ks:
        add("speculation.num_speculative_tokens", "empty list; give K or a list such as [0, 3]")
    for i, v in enumerate(ks):
        if isinstance(v, bool) or v < 0 or v > MAX_K:
            add("speculation.num_speculative_tokens", f"K={v} is outside 0..{MAX_K}")
    if isinstance(k, list) and len(set(k)) != len(k):
        add("speculation.num_speculative_tokens", f"duplicate values in {k}")
    if r.draft.method in ("draft_model", "turbo", "eagle3") and ks and max(ks) == 0:
        add("speculation.num_speculative_tokens", f"{r.draft.method} needs K >= 1")
    for b, kb in (r.speculation.num_speculative_tokens_per_batch_size or {}).items():
        if b < 1 or not 0 <= kb <= MAX_K:
            add("speculation.num_speculative_tokens_per_batch_size", f"{b}: {kb}: batch sizes "
                f"must be >= 1 and Ks in 0..{MAX_K}")
    if r.speculation.draft_p_min and r.draft.method not in CONFIDENT_METHODS:
        add("speculation.draft_p_min", f"method '{r.draft.method}' has no draft distribution to "
            f"be confident in ({' and '.join(CONFIDENT_METHODS)} have one); remove this key")
    s = r.shapes
    compiled = ks + list((r.speculation.num_speculative_tokens_per_batch_size or {}).values())
    kmax = max(compiled or [0])
    if s.prefill_seq_len < kmax + 1:
        add("shapes.prefill_seq_len", f"{s.prefill_seq_len} is less than K+1 = {kmax + 1}; the "
            "target's prefill specialization must hold a whole verify window")
    if s.prefill_seq_len > s.ctx_len:
        add("shapes.prefill_seq_len", f"{s.prefill_seq_len} is larger than ctx_len {s.ctx_len}")
    tails = s.prefill_tail_seq_lens
    if len(set(tails)) != len(tails):
        add("shapes.prefill_tail_seq_lens", f"duplicate values in {tails}")
    windows = {1} | {k + 1 for k in compiled if isinstance(k, int)}
    for w in tails:
        if not 1 <= w < s.prefill_seq_len:
            add("shapes.prefill_tail_seq_lens", f"{w} is outside 1..{s.prefill_seq_len - 1}: a "
                "tail window is narrower than prefill_seq_len")
        elif w in windows:
            add("shapes.prefill_tail_seq_lens", f"{w} is already a verify window (K+1 for K="
                f"{w - 1}); one specialization per width")
    if s.ctx_len % CTX_LEN_MULTIPLE:
        add("shapes.ctx_len", f"{s.ctx_len} is not a multiple of {CTX_LEN_MULTIPLE} (see docs/recipe.md, "
            "'ctx_len rule')")
    if s.full_batch_size is not None and s.full_batch_size < s.batch_size:
        add("shapes.full_batch_size", f"{s.full_batch_size} is smaller than batch_size {s.batch_size}")


# What a head method needs of the recipe: its folder (the files it holds), no checkpoint keys
# (why not), and one node (why).
HEAD_FOLDERS = {
    "turbo": ("speculator_config.json and speculator.safetensors",
              "turbo heads are a local folder read through the target's own LM head",
              "turbo heads ride in the target's graph, which a disaggregated bundle splits"),
    "eagle3": ("config.json and model.safetensors, the speculators format",
               "an EAGLE-3 head is a local folder with its own draft vocabulary (d2t)",
               "eagle3 reads the target's features on the node that verifies, which a "
               "disaggregated bundle splits from the prefill")}


def _head_options(r: Recipe, add: Add) -> None:
    d = r.draft
    files, local, one_node = HEAD_FOLDERS[d.method]
    if not d.model:
        add("draft.model", f"{d.method} needs its head folder ({files})")
    for key in ("revision", "vocab_subset"):
        if getattr(d, key) is not None:
            add(f"draft.{key}", f"{local}; remove this key")
    if r.disaggregated is not None:
        add("draft.method", f"{one_node}; use one node")


def _draft_options(r: Recipe, add: Add) -> None:
    d = r.draft
    if d.method == "draft_model" and not d.model:
        add("draft.model", "draft_model needs a draft model (Hugging Face id or local folder)")
    if d.method in HEAD_FOLDERS:
        _head_options(r, add)
    elif d.method != "draft_model":
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


def _numerics_options(r: Recipe, add: Add) -> None:
    """Card formats, emulated weights and the backends they need."""
    p, h, d = r.precision, r.hardware, r.draft
    # Without qaic the card's formats are emulated on ONNX Runtime (the numerics preview),
    # which only the fused graph does (at any batch size: it runs once per row); next to qaic
    # a portable ORT graph stays exact (a plan warning says so).
    if "qaic" not in r.backends and r.onnxruntime.graph == "portable":
        for key, fmt, off in (("precision.kv_cache_dtype", "mxint8", "float16"),
                              ("precision.quantization", "mxfp6", "none")):
            if getattr(p, key.split(".")[1]) == fmt:
                add(key, f"{fmt} is emulated on ONNX Runtime in the fused graph only, but "
                    f"onnxruntime.graph is portable; use the fused graph, add qaic to backends "
                    f"(the card), or use {off}")
    if p.kv_cache_dtype == "mxint8" and h.aic_hw_version != "ai100":
        add("precision.kv_cache_dtype", f"mxint8 KV is only known to work on ai100, not "
            f"{h.aic_hw_version}", "warning")
    if len(r.backends) != len(set(r.backends)):
        add("backends", f"duplicate backends in {r.backends}")
    for role in ("draft", "target"):
        key, fmt = f"onnxruntime.{role}_weights", getattr(r.onnxruntime, f"{role}_weights")
        block_key = f"onnxruntime.{role}_block_size"
        block = getattr(r.onnxruntime, f"{role}_block_size")
        if block is not None and fmt == "float32":
            add(block_key, f"blocks are for int8/int4 weights, but {key} is float32")
        elif block is not None and p.quantization == "mxfp6":
            add(block_key, "precision.quantization: mxfp6 emulates the card's blocks of 32; "
                "leave the block size out")
        if fmt == "float32":
            continue
        if role == "draft" and d.method not in ("draft_model", "eagle3"):
            add(key, f"method '{d.method}' has no draft model or head of its own")
        elif r.onnxruntime.graph != "fused":
            add(key, f"{fmt} {role} weights need onnxruntime.graph: fused")
        elif fmt == "int4" and p.quantization == "mxfp6":
            add(key, "int4 blocks cannot hold the MXFP6 values precision.quantization: mxfp6 "
                "emulates; use int8 (exact) or float32")


# ---------------------------------------------------------------- overrides and entry point
def apply_override(data: dict[str, Any], assignment: str) -> None:
    """`--set shapes.ctx_len=4096`: the value is parsed as a YAML scalar or flow sequence."""
    if "=" not in assignment:
        raise RecipeError("--set", [Problem(assignment, "expected KEY.PATH=VALUE")])
    key, raw = assignment.split("=", 1)
    value, _ = parse_yaml(raw or '""', f"--set {key}")
    _set_key(data, key, value)


def _set_key(data: dict[str, Any], key: str, value: Any) -> None:
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
    `changes`, see with_changes); raises RecipeError listing every problem."""
    path = Path(path)
    source = str(path)
    raw = read_capped(path, source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(source, [Problem("<file>", f"not UTF-8 text ({exc.reason} at byte "
                                           f"{exc.start})")]) from None
    recipe = recipe_from_text(text, source, overrides, base_dir=path.resolve().parent)
    return with_changes(recipe, changes) if changes else recipe


def _without(data: dict[str, Any], locs: list[KeyPath]) -> dict[str, Any]:
    """A copy of data with the keys at `locs` removed, so defaults stand in for bad values."""
    out = copy.deepcopy(data)
    for loc in locs:
        node: Any = out
        for part in loc[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(loc[-1], None)
    return out


def _cross_field_problems(data: dict[str, Any], exc: ValidationError,
                          lines: dict[KeyPath, int]) -> list[Problem]:
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


def _missing_model_folders(data: dict[str, Any], base_dir: Path | None,
                           lines: dict[KeyPath, int]) -> list[Problem]:
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


def recipe_from_text(text: str, source: str = "<recipe>",
                     overrides: list[str] | tuple[str, ...] = (),
                     base_dir: Path | None = None) -> Recipe:
    duplicates: list[Problem] = []
    data, lines = parse_yaml(text, source, duplicates)
    if not isinstance(data, dict):
        raise RecipeError(source, [Problem("<root>", f"a recipe is a mapping of keys "
                                           f"(schema, name, target, ...), not a {type(data).__name__}")])
    if any(not isinstance(key, str) for key in data):
        raise RecipeError(source, [Problem("<root>", "keys must be strings")])
    for assignment in overrides:
        apply_override(data, assignment)
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
    return _placed(recipe, source, base_dir or Path.cwd(), problems)


def _placed(recipe: Recipe, source: str, base_dir: Path, problems: list[Problem]) -> Recipe:
    recipe._source_dir = base_dir
    recipe._source = source
    recipe._warnings = [p for p in problems if p.severity == "warning"]
    return recipe


def with_changes(recipe: Recipe, changes: RecipeChanges) -> Recipe:
    """`recipe` with a stage's `changes` (pydantic's model_copy(update=) on each section they
    name), validated again as a whole: a change that breaks a rule, alone or with the rest of
    the recipe, raises RecipeError naming the recipe's file. The result keeps where the recipe
    came from (its folder resolves relative model paths) and its line numbers."""
    if not changes:
        return recipe
    update: dict[str, Any] = {}
    if changes.backends is not None:
        update["backends"] = list(changes.backends)
    for section, values in changes.sections():
        update[section] = getattr(recipe, section).model_copy(update=dict(values))
    try:  # model_copy does not validate: the recipe is validated again from its fields
        changed = Recipe.model_validate(recipe.model_copy(update=update).model_dump(by_alias=True))
    except ValidationError as exc:
        raise RecipeError(recipe.source, [Problem(dotted(e["loc"]), e["msg"])
                                          for e in exc.errors()]) from None
    changed._lines = recipe._lines
    problems = static_problems(changed)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise RecipeError(recipe.source, errors)
    return _placed(changed, recipe.source, recipe.source_dir(), problems)


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

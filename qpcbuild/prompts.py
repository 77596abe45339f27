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
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                item = json.loads(line)
                value = item["prompt"] if "prompt" in item else item["text"]
            except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
                raise UsageError(f"{path}:{n}: a JSON line needs a \"prompt\" (or \"text\") "
                                 "string") from None
            if not isinstance(value, str) or not value:
                raise UsageError(f"{path}:{n}: empty or non-string prompt")
            prompts.append(value)
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts

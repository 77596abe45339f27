"""Chat prompts: the bundle tokenizer's chat template applied to messages, as Hugging Face
tokenizers and vLLM's chat endpoint do.

The template comes from the bundle (tokenizer/chat_template.jinja, else the `chat_template` key of
tokenizer_config.json), so it is untrusted text: it is rendered in jinja2's immutable sandbox,
which refuses attribute access to Python internals and mutation of the passed values.
"""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any, NoReturn

from ..errors import BundleError, UsageError

ROLES = ("system", "user", "assistant", "tool")


def read_chat_template(tokenizer_dir: Path) -> str | None:
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg_file = tokenizer_dir / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    try:
        template = json.loads(cfg_file.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise BundleError(f"{cfg_file}: not a JSON object ({exc})") from None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def special_token(tokenizer_dir: Path, key: str) -> str:
    cfg_file = tokenizer_dir / "tokenizer_config.json"
    if not cfg_file.is_file():
        return ""
    value = json.loads(cfg_file.read_text(encoding="utf-8")).get(key)
    if isinstance(value, dict):  # AddedToken as saved by older transformers
        value = value.get("content")
    return value if isinstance(value, str) else ""


def as_messages(prompt: object, system: str | None = None) -> list[dict[str, Any]]:
    """A prompt string is one user turn; a list of {"role", "content"} dicts is a conversation."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        messages = prompt
    else:
        raise UsageError("a chat prompt is a string or a non-empty list of messages")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES \
                or not isinstance(m.get("content"), str):
            raise UsageError(f"message {n}: needs role ({' | '.join(ROLES)}) and string content")
    if system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
    return messages


class NoChatTemplate(UsageError):
    """The bundle cannot render chat messages (the server words this for HTTP clients)."""


class ChatTemplate:
    def __init__(self, tokenizer_dir: Path):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source = read_chat_template(tokenizer_dir)
        if source is None:
            raise NoChatTemplate(f"{tokenizer_dir}: the bundle's tokenizer has no chat "
                                 "template; give plain prompts (without --chat)")
        # The settings Hugging Face renders templates with, so the text is the same.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise BundleError(f"{tokenizer_dir}: chat template does not parse: {exc}") from None
        self.tokens = {k: special_token(tokenizer_dir, k) for k in ("bos_token", "eos_token")}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.tokens)
        except TemplateError as exc:
            raise UsageError(f"the chat template refused these messages: {exc}") from None


def _raise(message: str) -> NoReturn:
    from jinja2 import TemplateError

    raise TemplateError(message)

"""OpenAI request bodies, checked strictly where a value matters and lenient where clients send
fields that do not change the result here (user, stream_options, ...).

Types are strict (pydantic's strict mode): `"stream": "yes"` or `"max_tokens": "5"` is refused, as
OpenAI's own API refuses them, rather than coerced."""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Accepted and ignored: they do not change what this server returns.
IGNORED = {"user", "presence_penalty", "frequency_penalty", "logit_bias", "service_tier",
           "store", "metadata", "parallel_tool_calls", "suffix"}
# OpenAI's limit on the number of stop strings, and a bound on their length: the text held back
# while it may still become a stop string is at most this long, and stop strings of a megabyte
# (a 4 MB body is allowed) would make every check slow.
MAX_STOPS, MAX_STOP_CHARS = 4, 256


class BadRequest(ValueError):
    """A request body that cannot be served: HTTP 400, with the offending field when known."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, lt=2**31)  # vLLM's extension; 0 = off (vLLM: -1)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per prompt
    # Accepted only at their "off" values.
    logprobs: Union[bool, int, None] = None
    echo: bool = False
    best_of: Optional[int] = Field(default=None, ge=1, le=1)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported by this server")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @property
    def limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: Union[str, list[str]]

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if not prompts or any(not isinstance(p, str) or not p for p in prompts):
            raise ValueError("prompt must be a non-empty string or list of non-empty strings")
        if len(prompts) > 64:
            raise ValueError("at most 64 prompts per request")
        return prompts


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # name, tool_call_id, ...

    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, list[dict]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:  # OpenAI content parts: only text is understood here
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)


def strip_ignored(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in IGNORED}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_request(raw: bytes, schema: type[_Request]) -> _Request:
    """The request body as a checked model, or BadRequest naming what is wrong. Runs in a worker
    thread: decoding a 4 MB body is CPU work the event loop must not wait on."""
    try:  # malformed, deeply nested, NaN, or an integer past Python's 4,300-digit limit
        body = json.loads(raw, parse_constant=_no_constant)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates ("\ud800")
    except UnicodeEncodeError:
        raise BadRequest("request body has a lone UTF-16 surrogate (such as \"\\ud800\"); "
                         "text must be valid Unicode") from None
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise BadRequest(f"request body is not valid JSON: {reason}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        return schema.model_validate(strip_ignored(body))
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"{where}: {first['msg']}", param=where) from None

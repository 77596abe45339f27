"""OpenAI request bodies, checked strictly where a value matters and lenient where clients send
fields that do not change the result here (user, stream_options, ...)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Accepted and ignored: they do not change what this server returns.
IGNORED = {"user", "presence_penalty", "frequency_penalty", "logit_bias", "service_tier",
           "store", "metadata", "parallel_tool_calls", "suffix"}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # vLLM's extension; 0 = off (vLLM: -1)
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
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
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
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...

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

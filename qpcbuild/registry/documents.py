"""What a registry sends as JSON (manifests, referrers indexes, token replies), read with
bounds and checked by model before any field is used, as the bundle manifest is.

A registry is not trusted to be well-formed: a body that never ends, JSON nested 100,000 deep,
a manifest that is a list or whose `annotations` is one, must each end in a RegistryError that
names the document, not in a traceback or a process that fills its memory. Fields outside the
models are dropped: nothing downstream reads them, and a deep tree hidden in one cannot reach a
recursive function later (re-encoding a referrers index, say)."""

from __future__ import annotations

import json
from typing import Iterable, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import RegistryError

# The distribution spec asks registries to accept manifests of at least 4 MiB; a bundle of
# several thousand files stays well under that.
MAX_MANIFEST_BYTES = 4 << 20
MAX_TOKEN_BYTES = 1 << 20  # a JWT is a few kB
MAX_ERROR_BYTES = 64 << 10  # what is read of an error body (only its start is shown)


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, populate_by_name=True)


class Descriptor(_Document):
    mediaType: str = ""
    digest: str = Field(pattern=r"^[a-z0-9]+(?:[+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]+$")
    size: int = Field(ge=0)
    artifactType: Optional[str] = None
    annotations: Optional[dict[str, str]] = None
    urls: Optional[list[str]] = None
    platform: Optional[dict[str, str | list[str]]] = None


class ImageManifest(_Document):
    schemaVersion: int
    mediaType: Optional[str] = None
    artifactType: Optional[str] = None
    config: Optional[Descriptor] = None
    layers: list[Descriptor] = []
    subject: Optional[Descriptor] = None
    annotations: Optional[dict[str, str]] = None


class ImageIndex(_Document):
    schemaVersion: int
    mediaType: Optional[str] = None
    artifactType: Optional[str] = None
    manifests: list[Descriptor]
    subject: Optional[Descriptor] = None
    annotations: Optional[dict[str, str]] = None


class TokenReply(_Document):
    token: Optional[str] = None
    access_token: Optional[str] = None

    @property
    def bearer(self) -> str:
        return self.token or self.access_token or ""


Model = TypeVar("Model", bound=_Document)


def read_bounded(pieces: Iterable[bytes], limit: int, what: str) -> bytes:
    """The pieces joined, or RegistryError once they pass `limit` bytes (an endless body)."""
    data = bytearray()
    for piece in pieces:
        data += piece
        if len(data) > limit:
            raise RegistryError(f"{what}: the registry sent more than {limit:,} bytes; "
                                "refusing it")
    return bytes(data)


def parse(data: bytes, model: type[Model], what: str) -> Model:
    """`data` as JSON checked against `model`; RegistryError names what is wrong."""
    try:
        raw = json.loads(data)
    except RecursionError:
        raise RegistryError(f"{what}: the registry's JSON is nested too deep; refusing it") \
            from None
    except ValueError as exc:  # not JSON, not UTF-8, or a number beyond the int-string limit
        raise RegistryError(f"{what}: the registry's answer is not JSON "
                            f"({str(exc)[:120]})") from None
    if not isinstance(raw, dict):
        kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(
            type(raw), "a number")
        raise RegistryError(f"{what}: the registry's answer is {kind}, not a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise RegistryError(f"{what}: not a valid {model.__name__}: field {where}: "
                            f"{first['msg']}") from None
    except RecursionError:
        raise RegistryError(f"{what}: the registry's JSON is nested too deep; refusing it") \
            from None


def as_dict(document: _Document) -> dict:
    """The checked document as the plain JSON dict callers read (fields it lacks left out)."""
    return document.model_dump(mode="json", exclude_none=True)

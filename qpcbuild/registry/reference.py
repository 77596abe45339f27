"""Registry references: `host[:port]/repository[:tag][@sha256:digest]`, parsed and checked.

The registry host is always written out (there is no default registry): a bundle reference
names exactly one server, so a typo can never send a bundle somewhere else.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from ..errors import UsageError

# The distribution spec's grammar for repository path components and tags.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*"
                   r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
DEFAULT_TAG = "latest"
# `user:password@` (after an optional `https://`) in front of a host: a credential typed into a
# reference, which no message may repeat.
_USERINFO = re.compile(r"((?:[A-Za-z][A-Za-z0-9+.-]*://)?)[^/@]*@")


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port]
    repository: str
    tag: str | None = None
    digest: str | None = None  # "sha256:<hex>"

    @property
    def pinned(self) -> str:
        """What to ask the registry for: the digest when there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + \
            (f"@{self.digest}" if self.digest else "")


def check_tag(tag: str) -> str:
    if not TAG.fullmatch(tag):
        raise UsageError(f"'{tag}' is not a valid registry tag (letters, digits, '_', '.', '-'; "
                         "at most 128 characters, not starting with '.' or '-')")
    return tag


def carries_credentials(text: str) -> bool:
    """True when `text` has `user[:password]@` before its first '/' (after any `https://`):
    nothing a reference may hold, so taken for credentials whatever the host looks like."""
    m = _USERINFO.match(text)
    return bool(m) and "/" in text[m.end():]


def redacted(text: str) -> str:
    """`text` as a message may show it: credentials before the host replaced by `***`."""
    return _USERINFO.sub(r"\1***@", text, count=1) if carries_credentials(text) else text


def looks_like_reference(text: str) -> bool:
    """True when `text` starts with a registry host (a name with a dot or port, or localhost)."""
    host = text.split("/", 1)[0]
    return "/" in text and (host == "localhost" or "." in host or ":" in host) \
        and bool(_HOST.fullmatch(host))


def parse_reference(text: str, where: str = "reference", tag_allowed: bool = True) -> Reference:
    """Parse `host[:port]/repo[:tag][@sha256:...]`; a UsageError names what is wrong, without
    repeating a credential typed into the reference."""
    if carries_credentials(text):
        raise UsageError(f"{where} '{redacted(text)}': a reference never carries credentials "
                         "(they would be kept in shell history and echoed in logs); give them "
                         "with `docker login` or $QPCBUILD_REGISTRY_USERNAME and "
                         "$QPCBUILD_REGISTRY_PASSWORD, and write the reference without them")
    rest, _, digest = text.partition("@")
    if digest and not DIGEST.fullmatch(digest):
        # what follows '@' is not repeated: it may be a password typed in the wrong place
        raise UsageError(f"{where} '{rest}@…': the part after '@' must be a digest, sha256: "
                         "and 64 lowercase hex digits")
    host, slash, path = rest.partition("/")
    if not slash or not looks_like_reference(rest):
        raise UsageError(f"{where} '{text}': expected REGISTRY/REPOSITORY[:TAG][@sha256:...], "
                         "with the registry host written out (e.g. localhost:5000/team/demo:v1 "
                         "or ghcr.io/org/demo:v1)")
    repository, tag = path, None
    if ":" in path.rsplit("/", 1)[-1]:
        repository, tag = path.rsplit(":", 1)
        if not tag_allowed:
            raise UsageError(f"{where} '{text}': give a repository without a tag (qpcbuild adds "
                             "one tag per cache key)")
        check_tag(tag)
    if not _REPOSITORY.fullmatch(repository) or len(repository) > 255:
        raise UsageError(f"{where} '{text}': '{repository}' is not a valid repository name "
                         "(lowercase letters, digits and . _ - separators, '/' between parts)")
    return Reference(host, repository, tag, digest or None)


def is_loopback(registry: str) -> bool:
    """Is this registry on this machine (where plain HTTP is the norm and harmless)?"""
    host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

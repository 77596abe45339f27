"""How registry failures reach the user: bad credentials and unknown references are bad input
(exit 2); a registry that is down or answers nonsense is a failure (exit 1)."""

from __future__ import annotations

import httpx

from ..errors import QpcbuildError


class RegistryError(QpcbuildError):
    """The registry answered something we cannot use. Exit code 1."""


class RegistryUnavailable(RegistryError):
    """Not reachable, timed out, or a server error: worth a retry or a local fallback."""


class RegistryAuthError(RegistryError):
    """Credentials missing or refused. Exit code 2: the user must fix their login."""

    exit_code = 2


class RegistryNotFound(RegistryError):
    """No such repository, tag or blob. Exit code 2 (a wrong reference)."""

    exit_code = 2


class RegistryDigestMismatch(RegistryError):
    """The registry refused an upload whose bytes do not hash to the digest we named."""


def transport_error(registry: str, exc: httpx.HTTPError) -> RegistryUnavailable:
    reason = str(exc) or type(exc).__name__
    hint = "; is it running, and is it HTTPS (pass --insecure for a plain-HTTP registry " \
        "that is not on this machine)?" if isinstance(exc, httpx.ConnectError) else ""
    return RegistryUnavailable(f"registry {registry} is not reachable ({reason}){hint}")

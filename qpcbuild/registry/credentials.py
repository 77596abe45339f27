"""Registry credentials, found where registries' own tools keep them.

In order: the environment (QPCBUILD_REGISTRY_USERNAME with QPCBUILD_REGISTRY_PASSWORD, for CI
secrets; with QPCBUILD_REGISTRY_HOST set, only for that host), then the Docker config file
($DOCKER_CONFIG/config.json or ~/.docker/config.json):
a credential helper named for the host in `credHelpers` or for all hosts in `credsStore`
(`docker-credential-NAME get`, the host on stdin, JSON with Username and Secret on stdout), or
the base64 `user:password` (or an `identitytoken`) under `auths`. Secrets are never accepted
on the command line, never printed, and kept out of every repr.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

USERNAME_ENV = "QPCBUILD_REGISTRY_USERNAME"
PASSWORD_ENV = "QPCBUILD_REGISTRY_PASSWORD"
HOST_ENV = "QPCBUILD_REGISTRY_HOST"  # optional: the one registry the variables are for
IDENTITY_TOKEN_USER = "<token>"  # a credential helper's way of saying "Secret is a token"


@dataclass(frozen=True)
class Credentials:
    username: str | None
    password: str | None = field(default=None, repr=False)
    identity_token: str | None = field(default=None, repr=False)  # an OAuth2 refresh token
    source: str = ""  # where they came from, for error messages (never the secret itself)


def docker_config_path() -> Path:
    return Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"


def _host_key(key: str) -> str:
    """`https://host:port/v1/` -> `host:port`, as Docker itself matches `auths` keys."""
    key = key.split("://", 1)[-1]
    return key.split("/", 1)[0]


def _from_helper(helper: str, registry: str) -> Credentials | None:
    program = f"docker-credential-{helper}"
    try:
        done = subprocess.run([program, "get"], input=registry, capture_output=True, text=True,
                              timeout=60, check=False)
    except FileNotFoundError:
        raise UsageError(f"{docker_config_path()}: credential helper {program} (named for "
                         f"{registry}) is not installed") from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"credential helper {program} did not answer within 60 s") from None
    if done.returncode != 0:  # "credentials not found in native keychain" and the like
        return None
    try:
        reply = json.loads(done.stdout)
        user, secret = reply["Username"], reply["Secret"]
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"credential helper {program}: its answer is not the JSON object "
                         "{\"Username\", \"Secret\"} that helpers print") from None
    source = f"credential helper {program}"
    if user == IDENTITY_TOKEN_USER:
        return Credentials(None, identity_token=secret, source=source)
    return Credentials(user, secret, source=source)


def _from_auths(entry: dict, where: str) -> Credentials | None:
    if entry.get("identitytoken"):
        return Credentials(None, identity_token=entry["identitytoken"], source=where)
    if entry.get("username") and entry.get("password"):
        return Credentials(entry["username"], entry["password"], source=where)
    if not entry.get("auth"):
        return None
    try:
        user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        user, sep, password = "", "", ""
    if not sep or not user:
        raise UsageError(f"{where}: 'auth' must be base64 of USER:PASSWORD")
    return Credentials(user, password, source=where)


def find_credentials(registry: str) -> Credentials | None:
    """The credentials for `registry` (host[:port]), or None to try anonymously."""
    user, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
    scoped = os.environ.get(HOST_ENV)
    if (user or password) and (not scoped or _host_key(scoped) == registry):
        if not (user and password):
            raise UsageError(f"set both {USERNAME_ENV} and {PASSWORD_ENV}, or neither")
        return Credentials(user, password, source=f"${USERNAME_ENV}")
    path = docker_config_path()
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a readable Docker config file ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: not a JSON object")
    helper = (config.get("credHelpers") or {}).get(registry)
    if helper:
        return _from_helper(helper, registry)
    for key, entry in (config.get("auths") or {}).items():
        if _host_key(key) == registry and isinstance(entry, dict):
            found = _from_auths(entry, f"{path} (auths.{key})")
            if found:
                return found
    if config.get("credsStore"):
        return _from_helper(config["credsStore"], registry)
    return None

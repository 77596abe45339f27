"""The real OCI registry of qpcbuild.testing, as the tests start it: skipped outside CI, and a
failure in CI (which installs it), when the server or htpasswd is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from qpcbuild.testing import BINARY, RegistryServer


def require_registry() -> None:
    """Skip (outside CI) or fail (in CI, which installs it) when the server is missing."""
    if Path(BINARY).is_file():
        return
    if os.environ.get("CI"):
        pytest.fail("docker-registry is not installed; .ci/run installs it "
                    "(apt-get install -y docker-registry apache2-utils)")
    pytest.skip("docker-registry is not installed (apt-get install -y docker-registry "
                "apache2-utils); CI installs it")


def start_registry(root: Path, user: str | None = None,
                   password: str | None = None) -> RegistryServer:
    """A fresh registry; with `user`, one that asks for that user's password (Basic auth
    from an htpasswd file made with bcrypt, as the server requires)."""
    require_registry()
    htpasswd = None
    if user:
        if not shutil.which("htpasswd"):
            if os.environ.get("CI"):
                pytest.fail("htpasswd is not installed; .ci/run installs apache2-utils")
            pytest.skip("htpasswd (apache2-utils) is not installed")
        root.mkdir(parents=True, exist_ok=True)
        htpasswd = root / "htpasswd"
        subprocess.run(["htpasswd", "-Bbc", str(htpasswd), user, password], check=True,
                       capture_output=True)
    return RegistryServer(root, htpasswd).start()


def start_token_registry(root: Path, auth_config: str) -> RegistryServer:
    """A fresh registry that takes only Bearer tokens from the service `auth_config` names
    (token_server.py)."""
    require_registry()
    return RegistryServer(root, auth_config=auth_config).start()

"""A real OCI registry for tests: Debian's `docker-registry` (the CNCF distribution server),
one process per fixture, on a free loopback port, with scratch storage and a generated config,
stopped by its PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

BINARY = shutil.which("docker-registry") or "/usr/bin/docker-registry"


def require_registry() -> None:
    """Skip (outside CI) or fail (in CI, which installs it) when the server is missing."""
    if Path(BINARY).is_file():
        return
    if os.environ.get("CI"):
        pytest.fail("docker-registry is not installed; .ci/run installs it "
                    "(apt-get install -y docker-registry apache2-utils)")
    pytest.skip("docker-registry is not installed (apt-get install -y docker-registry "
                "apache2-utils); CI installs it")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RegistryServer:
    def __init__(self, root: Path, htpasswd: Path | None = None, auth_config: str = ""):
        self.root = Path(root)
        self.storage = self.root / "storage"
        self.htpasswd = htpasswd
        self.auth_config = auth_config  # an `auth:` section of its own (a token service)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "RegistryServer":
        self.port = self.port or free_port()
        self.storage.mkdir(parents=True, exist_ok=True)
        auth = (f"auth:\n  htpasswd:\n    realm: qpcbuild-test\n    path: {self.htpasswd}\n"
                if self.htpasswd else self.auth_config)
        config = self.root / "config.yml"
        config.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
                          f"    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
                          f"http:\n  addr: {self.address}\n{auth}")
        log = open(self.root / "registry.log", "ab")
        self.proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: "
                                   f"{(self.root / 'registry.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=1).status_code in (200, 401):
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("docker-registry did not answer within 20 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def blob_path(self, digest: str) -> Path:
        hexdigest = digest.split(":", 1)[-1]
        return (self.storage / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest /
                "data")

    def blob_bytes(self) -> int:
        """What the registry stores in blobs (each stored once, whoever refers to it)."""
        root = self.storage / "docker/registry/v2/blobs"
        return sum(p.stat().st_size for p in root.rglob("data")) if root.is_dir() else 0


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

"""docs/registry.md's local-registry how-to works as written: its Debian recipe (the config the
page gives, the port changed, $HOME a scratch folder) starts a registry that qpcbuild pushes the
demo bundle to and pulls it back from, byte for byte; the container recipe binds to loopback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from qpcbuild.cli import app
from qpcbuild.tree import hash_tree
from qpcbuild.testing import free_port
from registry_server import BINARY, require_registry

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "registry.md").read_text()
HOWTO = PAGE.split("## Run a local registry", 1)[1].split("\n## ", 1)[0]
pytestmark = pytest.mark.slow
runner = CliRunner()


def test_the_container_recipe_keeps_the_registry_on_loopback_with_its_storage_kept():
    run = re.search(r"docker run .*?registry:2", HOWTO, re.S).group(0)
    assert "-p 127.0.0.1:5000:5000" in run and "/var/lib/registry" in run


def test_the_debian_recipe_serves_a_registry_that_push_and_pull_use(registry_demo_bundle,
                                                                     tmp_path):
    require_registry()
    config = re.search(r"cat > ~/registry/config.yml <<EOF\n(.*?)\nEOF\n", HOWTO, re.S).group(1)
    port = free_port()
    (tmp_path / "registry" / "storage").mkdir(parents=True)
    text = config.replace("$HOME", str(tmp_path)).replace("127.0.0.1:5000", f"127.0.0.1:{port}")
    (tmp_path / "registry" / "config.yml").write_text(text)
    proc = subprocess.Popen([BINARY, "serve", str(tmp_path / "registry" / "config.yml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, "docker-registry exited on the page's config"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the registry never answered"
                time.sleep(0.1)
        ref = f"localhost:{port}/team/demo:v1"
        pushed = runner.invoke(app, ["push", str(registry_demo_bundle), ref, "--quiet"])
        assert pushed.exit_code == 0, pushed.output
        pulled = runner.invoke(app, ["pull", ref, "-d", str(tmp_path / "demo")])
        assert pulled.exit_code == 0, pulled.output
        assert hash_tree(tmp_path / "demo") == hash_tree(registry_demo_bundle)
        assert any((tmp_path / "registry" / "storage").rglob("data"))  # where the page says
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(10)

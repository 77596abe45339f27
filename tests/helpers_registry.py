"""The registry tests' two CLI steps, shared by test_registry.py and test_registry_signatures.py
(their registry and demo bundle are session fixtures in conftest.py; the registry server itself
is registry_server.py): compiling the demo recipe of a checkout, and pushing a bundle."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from qpcbuild.cli import app

runner = CliRunner()


def compile_demo(root: Path, out: Path, cache: Path, *extra: str) -> dict:
    result = runner.invoke(app, ["compile", str(root / "recipes" / "demo.yaml"), "-o", str(out),
                                 "--cache-dir", str(cache), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def push(bundle: Path, ref: str, **env) -> str:
    """Push `bundle` to `ref` (with `env` as the whole environment, where given): its digest."""
    result = runner.invoke(app, ["push", str(bundle), ref, "--quiet"], env=env or None)
    assert result.exit_code == 0, result.output
    return result.stdout.strip()

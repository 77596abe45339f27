"""The registry tests' CLI steps, shared by test_registry.py, test_registry_signatures.py,
test_remote_cache.py and test_compile_push.py (their registry and demo bundle are session
fixtures in conftest.py; the registry server itself is registry_server.py): a checkout of the
demo recipe, compiling it, and pushing a bundle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from qpcbuild.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def demo_checkout(root: Path) -> Path:
    """The demo recipe in a copy of the checkout (recipes and demo models): its recipe."""
    shutil.copytree(REPO / "models" / "demo", root / "models" / "demo")
    shutil.copytree(REPO / "recipes", root / "recipes")
    return root / "recipes" / "demo.yaml"


def compile_json(recipe: Path, out: Path, cache: Path, *extra: str) -> tuple[dict, str]:
    """`compile RECIPE -o OUT --cache-dir CACHE --json ...`: (its result, its stderr)."""
    result = runner.invoke(app, ["compile", str(recipe), "-o", str(out), "--cache-dir",
                                 str(cache), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def origins(result: dict) -> dict[str, str]:
    """Where each stage of a compile --json result came from (local | remote | built)."""
    return {s["stage"]: s["from"] for s in result["stages"]}


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

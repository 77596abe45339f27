"""The documentation stays true to the code: the CLI reference is the Typer app's own help, the
README stays a ten-minute read and its links land on files that exist. (`make docs` builds the
site with `mkdocs build --strict`, which fails on a broken link inside docs/.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cli_reference_matches_the_typer_app():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_reference.py"), "--check"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_manifest_schema_matches_the_model():
    """docs/manifest-schema.json is the typed Manifest's own JSON Schema."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "manifest_schema.py"),
                             "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_cli_reference_lists_every_command():
    import typer

    from qpcbuild.cli import app

    root = typer.main.get_command(app)
    page = (ROOT / "docs" / "cli.md").read_text()
    for name in root.list_commands(None):
        assert f"## `qpcbuild {name}`" in page, name


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links into docs/"
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, missing

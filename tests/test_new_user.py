"""What a new user meets on a fresh clone (issue 48, items 1-14): commands that make the folders
they need, errors that name the problem, advice that names what is installed."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from qpcbuild.cli import app
from qpcbuild.errors import UsageError
from qpcbuild.prompts import read_prompt_file

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


# ---------------------------------------------------------------- 11: keygen into a new folder
def test_keygen_makes_the_missing_keys_folder(tmp_path):
    key = tmp_path / "keys" / "release"
    result = runner.invoke(app, ["keygen", str(key)])
    assert result.exit_code == 0, result.output
    assert key.is_file() and Path(f"{key}.pub").is_file()
    assert oct(key.stat().st_mode & 0o777) == "0o600"


def test_keygen_under_a_file_exits_2_naming_it_and_writes_nothing(tmp_path):
    (tmp_path / "keys").write_text("not a folder")
    result = runner.invoke(app, ["keygen", str(tmp_path / "keys" / "release")])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert str(tmp_path / "keys") in " ".join(result.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys"]


# ---------------------------------------------------------------- 14: a JSON list is not a prompt
@pytest.mark.parametrize("text", ["[1,2]\n", "hello\n [1, 2] \n", '{"prompt": "a"}\n[1,2]\n'])
def test_a_prompt_line_that_is_a_json_list_is_refused_naming_the_line(tmp_path, text):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(UsageError, match=r"prompts.jsonl:\d: .*JSON list"):
        read_prompt_file(path)


def test_a_bracketed_text_prompt_that_is_not_json_stays_text(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("[INST] write a haiku [/INST]\n[1, 2\n")
    assert read_prompt_file(path) == ["[INST] write a haiku [/INST]", "[1, 2"]

"""tests/conftest.py deletes the scratch folders of module-scoped fixtures when their module ends
(the CI disk once filled up with real-model bundles kept to the end of the session), keeps the
session-scoped ones, and keeps everything when QPCBUILD_KEEP_TEST_DIRS=1.

Each test runs an inner pytest session (pytest's own `pytester`) whose conftest is the text of
ours, over two modules: the first makes the folders, the second, run after the first module's
fixtures are torn down, looks at what is left. The inner run is in-process: a second or so."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

OUR_CONFTEST = Path(__file__).with_name("conftest.py")

# Appended to our conftest, so that both inner modules share it.
SESSION_FIXTURE = '''

@pytest.fixture(scope="session")
def session_scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("session-scratch")
    (folder / "kept.txt").write_text("x")
    return folder
'''

# The module fixture asks for the session fixture first, so the session folder is made while the
# module fixture is being set up: it must still stay (it belongs to the session fixture).
MAKES_FOLDERS = '''
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def module_scratch(session_scratch, tmp_path_factory):
    folder = tmp_path_factory.mktemp("module-scratch")
    (folder / "big.bin").write_bytes(b"0" * 1024)
    return folder


def test_makes_folders(module_scratch, session_scratch):
    assert module_scratch.is_dir() and session_scratch.is_dir()
    Path("made.json").write_text(json.dumps({"module": str(module_scratch),
                                             "session": str(session_scratch)}))
'''

LOOKS_AT_THEM = '''
import json
import os
from pathlib import Path


def test_what_is_left(session_scratch):
    made = json.loads(Path("made.json").read_text())
    assert Path(made["session"]) == session_scratch
    assert (session_scratch / "kept.txt").is_file(), "the session folder must stay"
    module_left = Path(made["module"]).exists()
    if os.environ.get("QPCBUILD_KEEP_TEST_DIRS") == "1":
        assert module_left, "QPCBUILD_KEEP_TEST_DIRS=1 must keep the module folder"
    else:
        assert not module_left, "the module folder must go when its module ends"
'''


def _run_inner_session(pytester: pytest.Pytester) -> tuple[Path, Path]:
    pytester.makeconftest(OUR_CONFTEST.read_text() + SESSION_FIXTURE)
    # Names sort so that the module making the folders runs first.
    pytester.makepyfile(test_1_makes=MAKES_FOLDERS, test_2_looks=LOOKS_AT_THEM)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    made = json.loads((pytester.path / "made.json").read_text())
    return Path(made["module"]), Path(made["session"])


def test_a_module_fixtures_scratch_is_deleted_when_its_module_ends(pytester, monkeypatch):
    monkeypatch.delenv("QPCBUILD_KEEP_TEST_DIRS", raising=False)
    module_folder, session_folder = _run_inner_session(pytester)
    assert not module_folder.exists()
    assert session_folder.is_dir()


def test_keep_test_dirs_keeps_every_scratch_folder(pytester, monkeypatch):
    monkeypatch.setenv("QPCBUILD_KEEP_TEST_DIRS", "1")
    module_folder, session_folder = _run_inner_session(pytester)
    assert (module_folder / "big.bin").is_file()
    assert session_folder.is_dir()

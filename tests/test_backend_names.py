"""Backends sit behind one interface (qpcbuild/compile/__init__.py: BACKENDS, get_backend): the
bundle builder, the unit planner, the loader, run and serve dispatch through it and never name
a backend. A source scan for the names as string literals outside the places allowed to hold
them: the backend modules themselves, the CLI's choices and the recipe's list of valid names.

Not every module is there yet (issue 29, item 2): the plan still builds the qaic command line
and the ONNX Runtime settings, tune picks where to time calls, serve-config is the vllm-qaic
hand-off. LEFT is how many such lines remain; it may only go down (set it to the new count
when you move one behind the interface), and the target is zero."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qpcbuild"
NAME = re.compile(r"""(?<![\w.])["'](qaic|onnxruntime)["']""")
PACKAGE_NAME = re.compile(r"""(_pkg|_pkg_version|import_module|find_spec)\(["']onnxruntime""")
ALLOWED = ("compile/",                 # the backends and their registry
           "runtime/session.py",       # the ONNX Runtime session
           "runtime/qaic_session.py",  # the Cloud AI session
           "cli/",                     # the CLI's --backend choices and help
           "recipe.py",                # the recipe's list of valid names
           "toolchain.py")             # tool versions, by package name
LEFT = 19


def backend_name_lines(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if NAME.search(PACKAGE_NAME.sub("", code)):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_the_builder_loader_and_run_name_no_backend():
    found = backend_name_lines(PACKAGE)
    dispatching = ("bundle/build.py", "bundle/units.py", "runtime/loader.py", "server/")
    assert [f for f in found if f.startswith(dispatching)] == []
    assert len(found) <= LEFT, "\n".join(found)


def test_the_scan_finds_a_backend_name(tmp_path):
    (tmp_path / "compile").mkdir()
    (tmp_path / "compile" / "qaic.py").write_text('name = "qaic"\n')
    (tmp_path / "loader.py").write_text(
        'if backend == "onnxruntime":\n'
        "    pass\n"
        'cache = {"qaic": "qpc"}  # "qaic" in a comment is not code\n'
        'version = _pkg("onnxruntime")\n'
        'path = "target/qaic/compile.sh"\n')
    assert [line.split(":")[1] for line in backend_name_lines(tmp_path)] == ["1", "3"]

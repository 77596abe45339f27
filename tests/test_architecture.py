"""The package's layers as a contract: `lint-imports` (import-linter, configured in
.importlinter) keeps every import pointing down the layers, bench and tune apart and the
backends apart; a plain reading of the source with `ast` finds no import cycle. Imports inside
functions count in both. The tests themselves: no test module imports another (shared helpers
live in tests/helpers_*.py, shared fixtures in tests/conftest.py)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qpcbuild"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# Cycles known today, each with what removes it (none: the compile backends import their
# interface from bundle/backend.py, and the registry, backend_api.py, finds them by name).
KNOWN_CYCLES: list[set[str]] = []


def _lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: install the dev extras (import-linter)")
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / ".importlinter"),
                           "--no-cache"], cwd=package_parent, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_import_contracts_hold():
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_the_contracts_catch_an_upward_import_inside_a_function(tmp_path):
    """The check can fail: the recipe (bottom layer) importing the CLI from inside a function,
    in a copy of the package, breaks the layers contract, and lint-imports names the import."""
    shutil.copytree(PACKAGE, tmp_path / "qpcbuild",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))
    recipe = tmp_path / "qpcbuild" / "recipe" / "__init__.py"
    recipe.write_text(recipe.read_text() + "\n\ndef _upward():\n    from ..cli import app\n"
                      "    return app\n")
    run = _lint_imports(tmp_path)
    assert run.returncode != 0
    assert "qpcbuild.recipe is not allowed to import qpcbuild.cli" in run.stdout, run.stdout


# ---------------------------------------------------------------- cycles, read with ast
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every package module that `path` imports, at any depth of its code (functions and
    `if TYPE_CHECKING:` blocks included). `from a import b` is module a.b when that is a
    module, else a."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def _package_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": set(), "p.d": set()}
    assert _cycles(graph) == []
    graph["p.c"].add("p.a")
    assert _cycles(graph) == [{"p.a", "p.b", "p.c"}]


def test_no_module_imports_itself_back():
    """No import cycle between any two modules of the package (a package's __init__ counted as
    a module of its own), other than the known ones, which must still be there to be listed."""
    cycles = _cycles(_package_graph())
    unknown = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert unknown == [], f"import cycles: {unknown}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert gone == [], f"these cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_the_ast_reading_sees_imports_inside_functions():
    """Imports at any depth are edges of the graph (these two stand inside functions)."""
    graph = _package_graph()
    assert "qpcbuild.measuring" in graph["qpcbuild.tune.calibrate"]  # inside `tune`
    assert "qpcbuild.runtime.loader" in graph["qpcbuild"]  # inside `load`


# ---------------------------------------------------------------- tests import no test module
TESTS = ROOT / "tests"


def imported_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, name) of every test module (a `test_*` name) that `source` imports, at any depth
    of its code, with `import`, `from ... import` or `importlib.import_module`. A test module
    imported by another has its fixtures defined, and built, a second time and its tests
    collected twice; shared code belongs in a helpers_* module, shared fixtures in conftest.py."""
    def is_test(name: str) -> bool:
        return any(part.startswith("test_") for part in name.split("."))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # `from . import test_x` names the module last
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                               "__import__"):
            names = [node.args[0].value]
        else:
            continue
        found += [(node.lineno, name) for name in names if is_test(name)]
    return sorted(found)


def test_no_test_module_imports_another():
    offenders = {path.name: found for path in sorted(TESTS.glob("*.py"))
                 if (found := imported_test_modules(path.read_text(encoding="utf-8")))}
    assert offenders == {}, f"test modules imported by other modules (line, module): {offenders}"


def test_the_test_import_check_finds_imports_at_any_depth():
    source = (
        "import os\n"
        "from helpers_engine import Scripted\n"
        "from test_engine_rules import decoder\n"
        "import test_export as exported\n"
        "\n\n"
        "def test_something():\n"
        "    from test_server import LiveServer\n"
        "    import importlib\n"
        "    return importlib.import_module('test_registry')\n"
        "\n\n"
        "class Helper:\n"
        "    def method(self):\n"
        "        from . import test_qaic_backend\n")
    assert imported_test_modules(source) == [
        (3, "test_engine_rules"), (4, "test_export"), (8, "test_server"), (10, "test_registry"),
        (15, "test_qaic_backend")]
    assert imported_test_modules("import os\nfrom helpers_server import free_port\n") == []


def test_the_version_module_agrees_with_pyproject():
    import tomllib

    from qpcbuild.version import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__


# Size: a function over 80 lines or a module over 400 reads as one block where named steps would
# read better; where it does not, a comment says why, right above the function (above its
# decorators) or in the module's header (before its first import).
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 400
FUNCTION_REASON, MODULE_REASON = "# Over 80 lines:", "# Over 400 lines:"


def _comment_above(lines: list[str], first: int) -> str:
    """The block of comment lines directly above line `first` (1-based)."""
    block, i = [], first - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        block.append(lines[i].strip())
        i -= 1
    return "\n".join(reversed(block))


def oversized(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        if len(lines) > MAX_MODULE_LINES:
            first_import = next((n.lineno for n in tree.body
                                 if isinstance(n, (ast.Import, ast.ImportFrom))), len(lines) + 1)
            if not any(line.strip().startswith(MODULE_REASON)
                       for line in lines[:first_import - 1]):
                found.append(f"{rel}: {len(lines)} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if length > MAX_FUNCTION_LINES and \
                        FUNCTION_REASON not in _comment_above(lines, first):
                    found.append(f"{rel}:{node.lineno}: {node.name} {length} lines")
    return found


def test_no_long_function_or_module_without_a_reason():
    assert oversized(PACKAGE) == []


def test_the_size_check_finds_what_it_should(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (tmp_path / "long.py").write_text(
        "import os\n\n\ndef long_one():\n" + body +
        "\n\n# Over 80 lines: one table, splitting it hides nothing\n@staticmethod\n"
        "def explained():\n" + body +
        "\n\ndef short():\n    return 1\n")
    (tmp_path / "big.py").write_text("x = 1\n" * 401)
    (tmp_path / "big_ok.py").write_text('"""Doc."""\n# Over 400 lines: one table\nimport os\n'
                                        + "x = 1\n" * 400)
    assert oversized(tmp_path) == ["big.py: 401 lines", "long.py:4: long_one 81 lines"]


# ---------------------------------------------------------------- tests and benchmarks apart
BENCHMARKS = ROOT / "benchmarks"


def cross_imports(source: str, others: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each import in `source` of a module named in `others` (the other
    folder's top-level names), and each file loaded by path (importlib's
    spec_from_file_location) or sys.path entry that names one of them."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                ("spec_from_file_location", "sys.path.insert", "sys.path.append")):
            text = ast.unparse(node)
            if any(f"'{o}" in text for o in others):  # a quoted path that starts there
                found.append((node.lineno, text))
            continue
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in others]
    return sorted(found)


def test_tests_and_benchmarks_do_not_import_each_other():
    """What both need is in qpcbuild/testing.py; a benchmark's own tests live beside it
    (benchmarks/tests, benchmarks/peers/tests) and import it by name."""
    test_names = {p.stem for p in TESTS.glob("*.py")} | {"tests"}
    offenders = {str(p.relative_to(ROOT)): found for p in sorted(TESTS.glob("*.py"))
                 if (found := cross_imports(p.read_text(encoding="utf-8"), {"benchmarks"}))}
    offenders |= {str(p.relative_to(ROOT)): found for p in sorted(BENCHMARKS.rglob("*.py"))
                  if (found := cross_imports(p.read_text(encoding="utf-8"), test_names))}
    assert offenders == {}, offenders


def test_the_cross_import_check_finds_each_way_in():
    source = ("import sys\nfrom benchmarks.peers import PEERS\n\n\ndef f():\n"
              "    import importlib.util\n"
              "    importlib.util.spec_from_file_location('x', 'benchmarks/x.py')\n"
              "    sys.path.insert(0, str(ROOT / 'benchmarks'))\n")
    assert [line for line, _ in cross_imports(source, {"benchmarks"})] == [2, 7, 8]
    assert cross_imports("from registry_server import free_port\n", {"registry_server"}) == \
        [(1, "registry_server")]
    assert cross_imports("import os\nfrom qpcbuild.testing import free_port\n",
                         {"registry_server", "benchmarks"}) == []

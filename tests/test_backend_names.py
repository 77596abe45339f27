"""Each backend is one folder, qpcbuild/backends/<name>/, registered once (backend_api.BACKENDS):
the plan, the bundle builder, the manifest model, the loader and serve ask backend_api for a
backend's modules by name and never name one. What is checked here: the registry and the folders
agree (each registered backend has its four modules, each folder is registered, the recipe's
list of valid names is the registry's), and a source scan finds no backend name as a string
literal outside the places allowed to hold one. LEFT is how many such lines remain elsewhere:
none, so any new one fails."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from qpcbuild.backend_api import (BACKENDS, BackendEntry, BackendPart, backend_module,
                                  backend_plan, entry_model)
from qpcbuild.bundle.backend import get_backend
from qpcbuild.recipe.schema import CARD_BACKENDS, Backend

PACKAGE = Path(__file__).resolve().parents[1] / "qpcbuild"
NAME = re.compile(r"""(?<![\w.])["'](qaic|onnxruntime)["']""")
PACKAGE_NAME = re.compile(r"""(package_version|import_module|find_spec)\(["']onnxruntime""")
ALLOWED = ("backends/",                # the backends themselves
           "backend_api.py",           # the registry
           "runtime/session.py",       # the ONNX Runtime session
           "runtime/qaic_session.py",  # the Cloud AI session
           "cli/",                     # the CLI's --backend choices and help
           "recipe/__init__.py",       # the recipe's checks of the names it lists
           "recipe/changes.py",        # the recipe's sections a stage may change (its
                                       # `onnxruntime:` options section among them)
           "recipe/schema.py",         # the recipe's list of valid names
           "toolchain.py")             # tool versions, by package name
LEFT = 0


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
    dispatching = ("bundle/", "plan.py", "runtime/loader.py", "server/")
    assert [f for f in found if f.startswith(dispatching)] == []
    assert len(found) <= LEFT, "\n".join(found)


def test_the_scan_finds_a_backend_name(tmp_path):
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "qaic.py").write_text('name = "qaic"\n')
    (tmp_path / "loader.py").write_text(
        'if backend == "onnxruntime":\n'
        "    pass\n"
        'cache = {"qaic": "qpc"}  # "qaic" in a comment is not code\n'
        'version = package_version("onnxruntime")\n'
        'path = "target/qaic/compile.sh"\n')
    assert [line.split(":")[1] for line in backend_name_lines(tmp_path)] == ["1", "3"]


def test_each_folder_is_a_registered_backend_and_the_recipe_lists_the_same():
    folders = sorted(p.name for p in (PACKAGE / "backends").iterdir()
                     if p.is_dir() and (p / "__init__.py").is_file())
    assert folders == sorted(BACKENDS)
    assert list(get_args(Backend)) == list(BACKENDS)
    # the recipe's names of the backends that run on a card (where an EAGLE-3 head takes cores)
    assert CARD_BACKENDS == tuple(n for n, info in BACKENDS.items() if not info.runs_on_host)


def test_each_backend_has_its_plan_build_entry_and_session():
    for name in BACKENDS:
        assert hasattr(backend_plan(name), "plan_role"), name
        assert get_backend(name).name == name
        assert issubclass(entry_model(name), BackendEntry), name
        assert callable(backend_module(name, "session").open_session), name


def test_every_role_plans_every_backend_with_its_own_cache_key():
    from qpcbuild.plan import make_plan
    from qpcbuild.recipe import load_recipe

    plan = make_plan(load_recipe(PACKAGE.parent / "recipes" / "demo.yaml"),
                     compiler="qaic-compile")
    for rp in plan.roles:
        assert list(rp.backends) == list(BACKENDS)
        assert all(isinstance(part, BackendPart) for part in rp.backends.values())
        keys = rp.cache_keys.to_dict()
        assert list(keys) == ["export", *BACKENDS]
        assert len(set(keys.values())) == len(keys)

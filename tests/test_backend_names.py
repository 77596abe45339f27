"""Backends sit behind one interface (qpcbuild/compile/backends.py: BACKENDS, get_backend): the
bundle builder, the unit planner, the loader, run, serve, measuring and tune dispatch through it
and never name a backend. A source scan for the names as string literals outside the places
allowed to hold them: the backend modules themselves (with their planning half,
plan_backends/, which sits below the plan), the CLI's choices and the recipe's list of valid
names. LEFT is how many such lines remain elsewhere: none, so any new one fails."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from qpcbuild.compile.backends import BACKENDS
from qpcbuild.plan_backends import BACKEND_PLANS
from qpcbuild.recipe.schema import Backend

PACKAGE = Path(__file__).resolve().parents[1] / "qpcbuild"
NAME = re.compile(r"""(?<![\w.])["'](qaic|onnxruntime)["']""")
PACKAGE_NAME = re.compile(r"""(package_version|import_module|find_spec)\(["']onnxruntime""")
ALLOWED = ("compile/",                 # the backends and their registry
           "runtime/session.py",       # the ONNX Runtime session
           "runtime/qaic_session.py",  # the Cloud AI session
           "cli/",                     # the CLI's --backend choices and help
           "plan_backends/",           # each backend's planning (below the plan)
           "recipe/__init__.py",       # the recipe's checks of the names it lists
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
        'version = package_version("onnxruntime")\n'
        'path = "target/qaic/compile.sh"\n')
    assert [line.split(":")[1] for line in backend_name_lines(tmp_path)] == ["1", "3"]


def test_the_recipe_the_plan_and_the_registry_know_the_same_backends():
    assert list(BACKENDS) == list(BACKEND_PLANS) == list(get_args(Backend))


def test_each_backend_plans_its_own_fields_of_the_role_plan(monkeypatch):
    from dataclasses import fields

    import qpcbuild.plan as plan_mod
    from qpcbuild.plan_backends import RoleFacts
    from qpcbuild.recipe import load_recipe

    recipe = load_recipe(PACKAGE.parent / "recipes" / "demo.yaml")
    plan = plan_mod.make_plan(recipe, compiler="qaic-compile")
    role_fields = {f.name for f in fields(plan_mod.RolePlan)}
    facts = RoleFacts(role="target", cores=1, device_group=[0],
                      specializations=plan.role("target").specializations,
                      io=plan.role("target").io, export_key="k")
    owned = {name: set(backend.plan_role(recipe, facts, "qaic-compile"))
             for name, backend in BACKEND_PLANS.items()}
    for name, planned in owned.items():
        assert planned and planned <= role_fields, name
        others = set().union(*(v for n, v in owned.items() if n != name))
        assert not planned & others, name
    # a backend that plans a field another one planned is refused, not silently overridden
    first = next(iter(BACKEND_PLANS.values()))
    monkeypatch.setattr(plan_mod, "BACKEND_PLANS", {**BACKEND_PLANS, "twice": first})
    with pytest.raises(RuntimeError, match="another backend already planned"):
        plan_mod.make_plan(recipe, compiler="qaic-compile")

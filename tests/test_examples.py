"""The fan-out examples (examples/github-actions/bundles.yml, examples/kubernetes/
build-units.yaml) do what they say: their own commands, run as the CI system would run them
(each matrix job or pod a runner with its own empty cache folder and checkout), against a
local registry standing in for the team's, build every unit on separate runners and then
assemble a bundle from cache hits alone, with the same bundle id as a plain local build."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qpcbuild.bundle import verify_bundle
from qpcbuild.cli import app
from registry_server import start_registry

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
EXPR = re.compile(r"\$\{\{\s*([^}]+?)\s*\}\}")
runner = CliRunner()


@pytest.fixture(scope="module")
def plain_build(tmp_path_factory) -> dict:
    """The oracle: the demo bundle built on one machine without any registry."""
    root = tmp_path_factory.mktemp("plain")
    result = runner.invoke(app, ["compile", str(REPO / "recipes" / "demo.yaml"), "-o",
                                 str(root / "out"), "--cache-dir", str(root / "cache"), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


class Runner:
    """One CI machine: a fresh checkout and an empty local build cache."""
    count = itertools.count()

    def __init__(self, root: Path, env: dict[str, str]):
        self.dir = root / f"runner-{next(self.count)}"
        shutil.copytree(REPO / "models" / "demo", self.dir / "models" / "demo")
        shutil.copytree(REPO / "recipes", self.dir / "recipes")
        self.env = {**os.environ, **env, "QPCBUILD_CACHE": str(self.dir / "local-cache"),
                    # the project's interpreter and this checkout's qpcbuild, as `pip install .`
                    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                    "PYTHONPATH": str(REPO)}

    def start(self, argv: list[str], extra: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=self.dir, env={**self.env, **extra},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return out


# ---------------------------------------------------------------- GitHub Actions
def _lookup(path: str, ctx: dict):
    call = re.fullmatch(r"fromJSON\((.+)\)", path)
    if call:
        return json.loads(_lookup(call.group(1), ctx))
    value = ctx
    for part in path.split("."):
        value = value[part]
    return value


def _expand(value, ctx: dict):
    """GitHub's `${{ }}` expressions, as far as the workflow uses them (context lookups and
    fromJSON); a whole-string expression keeps its type (a matrix list stays a list)."""
    if isinstance(value, str):
        whole = EXPR.fullmatch(value.strip())
        if whole:
            return _lookup(whole.group(1), ctx)
        return EXPR.sub(lambda m: str(_lookup(m.group(1), ctx)), value)
    if isinstance(value, dict):
        return {k: _expand(v, ctx) for k, v in value.items()}
    return value


def _matrix_rows(job: dict, ctx: dict) -> list[dict]:
    matrix = _expand((job.get("strategy") or {}).get("matrix") or {}, ctx)
    if "include" in matrix:
        return list(matrix["include"])
    keys = sorted(matrix)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(matrix[k] for k in keys))]


def _run_row(name: str, job: dict, workflow: dict, ctx: dict, row: dict, tmp: Path) -> dict:
    """One matrix row on its own runner: its steps in order; returns the job's outputs."""
    local = {**ctx, "matrix": row, "steps": {}}
    env = {k: str(v) for k, v in {**_expand(workflow.get("env") or {}, local),
                                    **_expand(job.get("env") or {}, local)}.items()}
    machine = Runner(tmp / name, env)
    for n, step in enumerate(job["steps"]):
        if "uses" in step or step.get("id") == "install":  # the checkout is there already
            continue
        output = machine.dir / f"output-{n}"
        output.touch()
        finish(machine.start(["bash", "-e", "-c", _expand(step["run"], local)], {
            "GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": str(machine.dir / "summary")}))
        lines = output.read_text().splitlines()
        local["steps"][step.get("id", str(n))] = {
            "outputs": dict(line.split("=", 1) for line in lines if "=" in line)}
    return {"outputs": _expand(job.get("outputs") or {}, local), "dir": machine.dir}


def _run_job(name: str, job: dict, workflow: dict, ctx: dict, tmp: Path) -> list[dict]:
    """Every matrix row at once, as GitHub runs them."""
    rows = _matrix_rows(job, ctx) or [{}]
    with ThreadPoolExecutor(len(rows)) as pool:
        return list(pool.map(lambda row: _run_row(name, job, workflow, ctx, row, tmp), rows))


def test_the_github_actions_matrix_workflow(plain_build, tmp_path):
    registry = start_registry(tmp_path / "registry", "ci", "token-from-secrets")
    try:
        workflow = yaml.safe_load((REPO / "examples/github-actions/bundles.yml").read_text())
        ctx = {"vars": {"REGISTRY": f"{registry.address}/team"}, "github": {"sha": "abc123"},
               "secrets": {"REGISTRY_USERNAME": "ci", "REGISTRY_PASSWORD": "token-from-secrets"},
               "needs": {}}
        done = set()
        while len(done) < len(workflow["jobs"]):  # jobs in the order their `needs` allow
            for name, job in workflow["jobs"].items():
                needs = job.get("needs") or []
                needs = [needs] if isinstance(needs, str) else needs
                if name in done or not set(needs) <= done:
                    continue
                results = _run_job(name, job, workflow, ctx, tmp_path)
                ctx["needs"][name] = {"outputs": results[0]["outputs"]}
                done.add(name)
                if name == "plan":
                    units = {k: json.loads(v) for k, v in results[0]["outputs"].items()}
                    assert [r["unit"] for r in units["exports"]] == ["export-target",
                                                                       "export-draft"]
                    assert len(units["artifacts"]) == 2
        bundle_dir = results[0]["dir"]  # the last job: bundle
        build = json.loads((bundle_dir / "build.json").read_text())
        assert {s["from"] for s in build["stages"]} == {"remote"}  # assembled from hits alone
        assert build["bundle_id"] == plain_build["bundle_id"]
        assert_mounted(build["pushed"])
        assert build["pushed"]["pinned"] in (bundle_dir / "summary").read_text()
        pulled = runner.invoke(app, ["pull", build["pushed"]["pinned"],
                                     "-d", str(tmp_path / "pulled")],
                               env={"QPCBUILD_REGISTRY_USERNAME": "ci",
                                    "QPCBUILD_REGISTRY_PASSWORD": "token-from-secrets"})
        assert pulled.exit_code == 0, pulled.output
        assert verify_bundle(tmp_path / "pulled") == []
    finally:
        registry.stop()


def assert_mounted(pushed: dict) -> None:
    """The bundle job uploaded its small files only: the graphs were mounted from the cache's
    repository (the demo target's ONNX Runtime graph alone is several MB)."""
    assert pushed["transferred_bytes"] < pushed["bytes"] / 10, pushed


# ---------------------------------------------------------------- Kubernetes
def _pod(spec: dict, root: Path, address: str, secrets: dict, index: int | None):
    container = spec["template"]["spec"]["containers"][0]
    env = {}
    for var in container["env"]:
        if "valueFrom" in var:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            env[var["name"]] = var["value"].replace("registry.internal:5000", address)
    env.pop("QPCBUILD_CACHE")  # the pod's emptyDir: the runner's own empty cache folder
    machine = Runner(root, env)
    extra = {} if index is None else {"JOB_COMPLETION_INDEX": str(index)}
    return machine, machine.start([*container["command"], *container["args"]], extra)


def test_the_kubernetes_indexed_job(plain_build, tmp_path):
    registry = start_registry(tmp_path / "registry", "builder", "k8s-secret")
    try:
        units_job, bundle_job = yaml.safe_load_all(
            (REPO / "examples/kubernetes/build-units.yaml").read_text())
        secrets = {("registry-credentials", "username"): "builder",
                   ("registry-credentials", "password"): "k8s-secret"}
        spec = units_job["spec"]
        assert spec["completionMode"] == "Indexed"
        plan = runner.invoke(app, ["plan", str(REPO / "recipes" / "demo.yaml"), "--units",
                                   "--json"])
        assert spec["completions"] == len(json.loads(plan.stdout)["units"])
        pods = [_pod(spec, tmp_path / "units", registry.address, secrets, i)
                for i in range(spec["completions"])]  # parallelism = completions: all at once
        for _, proc in pods:
            finish(proc)
        machine, proc = _pod(bundle_job["spec"], tmp_path / "bundle", registry.address, secrets,
                             None)
        finish(proc)
        build = json.loads((machine.dir / "build.json").read_text())
        assert {s["from"] for s in build["stages"]} == {"remote"}
        assert build["bundle_id"] == plain_build["bundle_id"]
        assert_mounted(build["pushed"])
        pulled = runner.invoke(app, ["pull", build["pushed"]["pinned"], "-d",
                                     str(tmp_path / "pulled")],
                               env={"QPCBUILD_REGISTRY_USERNAME": "builder",
                                    "QPCBUILD_REGISTRY_PASSWORD": "k8s-secret"})
        assert pulled.exit_code == 0, pulled.output
        assert verify_bundle(tmp_path / "pulled") == []
    finally:
        registry.stop()

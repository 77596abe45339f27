"""The Qualcomm Cloud AI backend: compiler inputs from the plan, then qaic-compile exactly as
`qpcbuild plan` printed it. Without the SDK it stops early (or, with --emit-only, leaves a
runnable compile.sh per role). It never writes a programqpc.bin of its own."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any, Callable

from ...backend_api import EAGLE3_HEAD_UNIT
from ...cache import META, Cache
from ...errors import BundleError, ToolchainError
from ...models.specialization import Specialization
from ...plan import RolePlan
from ...toolchain import compiler_identity, qaic_sdk_versions
from ...tree import copy_tree
from ...bundle.backend import BuildContext
from .kv_names import card_graph_file, is_kv_name, write_card_graph
from .manifest import NAME, QPC_FILE, compiled_units
from .plan import QaicPart, custom_io_yaml, find_compiler, specializations_file


def missing_compiler_message(tried: list[str]) -> str:
    return ("the Qualcomm compiler was not found (looked for: " + ", ".join(tried) + "). Install "
            "the Cloud AI platform and apps SDK, or point at the binary with --compiler PATH or "
            "QAIC_COMPILER=PATH; or pass --emit-only to write the graphs, compiler inputs and a "
            "compile.sh per role for a machine that has the SDK.")


class QaicBackend:
    name = NAME
    cache_kind = "qpc"
    ships_graph = True  # the compiler inputs and compile.sh refer to the bundle's graph

    def runtime_problem(self) -> str | None:
        """Why sessions cannot run on a card here (None: they can)."""
        try:
            importlib.import_module("qaicrt")
        except Exception as exc:
            return f"qaicrt is not importable ({type(exc).__name__})"
        if find_compiler()[0] is None:
            return "no qaic-compile/qaic-exec found"
        return None

    def check(self, ctx: BuildContext) -> dict[str, Any]:
        compiler, tried = find_compiler(ctx.compiler)
        if compiler is None and not ctx.emit_only:
            raise ToolchainError(missing_compiler_message(tried))
        # By name and content: where the SDK is installed must not change the bundle id.
        return {"compiler": None if ctx.emit_only else compiler_identity(compiler),
                "sdk": qaic_sdk_versions(), "emit_only": ctx.emit_only}

    def key_inputs(self, role: RolePlan, export_digest: str, tools: dict[str, Any],
                   compiler: str | None, emit_only: bool) -> dict[str, Any]:
        path = None if emit_only else find_compiler(compiler)[0]
        return {"export": export_digest, "settings": role.cache_keys.backends[self.name],
                "sdk": tools["qaic_sdk"], "compiler": compiler_identity(path)}

    def build_cached(self, ctx: BuildContext, role: RolePlan, cache: Cache, key: str,
                     inputs: dict[str, Any], onnx_dir: Callable[[], Path]) -> tuple[dict, bool]:
        graph = onnx_dir()  # inside the staging bundle (ships_graph)
        if ctx.emit_only or not cache.keeps:
            # (without a cache the QPC stays where the compiler wrote it: no copy)
            return self.build(ctx, role, graph), False

        # The compiler runs in the staging bundle (its paths are bundle-relative); the cache
        # keeps the QPC and its log.
        def keep_qpc(tmp: Path) -> dict[str, Any]:
            result = self.build(ctx, role, graph)
            for unit in compiled_units(role.role, role.eagle3_head):
                for part in ("qpc", "logs"):
                    copy_tree(ctx.staging / unit / part, tmp / unit / part)
            return result

        entry, info, reused = cache.get_or_build(self.cache_kind, key, keep_qpc, inputs)
        if reused:
            self.write_inputs(ctx, role)
            cache.deliver(entry, ctx.staging, skip=(META,), known=ctx.delivered)
        return info, reused

    @staticmethod
    def part(role: RolePlan) -> QaicPart:
        """This backend's part of the role's plan."""
        part = role.backends[NAME]
        assert isinstance(part, QaicPart)  # planned by .plan.QaicPlan
        return part

    def write_inputs(self, ctx: BuildContext, role: RolePlan) -> list[str]:
        planned = self.part(role)
        if planned.kv_infix is not None:
            self.write_card_graph(ctx, role, planned)
        head = planned.eagle3_head
        if head is not None and role.eagle3_head is not None:  # first: the target's script runs it
            self.write_head_graph(ctx, role)
            write_unit_inputs(ctx, role.eagle3_head.unit, head, role.eagle3_head.specializations,
                              len(role.eagle3_head.device_group), finish=None)
        return write_unit_inputs(ctx, role.role, planned, role.specializations,
                                 len(role.device_group), finish=role.role,
                                 then=role.eagle3_head.unit if head and role.eagle3_head else None)

    @staticmethod
    def write_head_graph(ctx: BuildContext, role: RolePlan) -> None:
        """The EAGLE-3 head's card graph (export/eagle3_card.py) in its unit's onnx/ folder,
        from the head folder and the target's embedding in the bundle's target graph."""
        from ...export import GRAPH_FILE
        from ...export.eagle3_card import export_card_head, target_embedding

        assert role.eagle3 is not None
        head = role.eagle3.read(role.arch)
        embed = target_embedding(ctx.staging / role.model_role / "onnx" / GRAPH_FILE)
        export_card_head(head, embed, role.arch.max_position_embeddings,
                         ctx.plan.recipe.shapes.full_batch_size is not None,
                         ctx.staging / EAGLE3_HEAD_UNIT / "onnx")

    @staticmethod
    def write_card_graph(ctx: BuildContext, role: RolePlan, planned: QaicPart) -> None:
        """The graph with vllm-qaic's KV names that a disaggregated unit compiles, beside the
        exported one; its KV I/O, read back from the file, must be custom_io.yaml's."""
        assert planned.kv_infix is not None
        inputs, outputs = write_card_graph(ctx.staging / role.model_role / "onnx",
                                           planned.kv_infix)
        in_graph = [n for n in (*inputs, *outputs) if is_kv_name(n)]
        listed = [e["IOName"] for e in planned.custom_io]
        if sorted(in_graph) != sorted(listed):
            raise BundleError(f"{role.role}: the card graph's KV buffers {in_graph[:2]}... are "
                              f"not custom_io.yaml's {listed[:2]}...")

    def build(self, ctx: BuildContext, role: RolePlan, onnx_dir: Path) -> dict[str, Any]:
        args = self.write_inputs(ctx, role)
        entry: dict[str, Any] = {"inputs": f"{role.role}/qaic", "compile_script":
                                 f"{role.role}/qaic/compile.sh",
                                 "compiler_args": args}
        planned = self.part(role)
        if planned.kv_infix is not None:  # only then: an aggregated entry is as before
            entry.update(graph=f"{role.model_role}/onnx/{card_graph_file(planned.kv_infix)}",
                         kv_infix=planned.kv_infix,
                         kv_buffers=[e["IOName"] for e in planned.custom_io])
        head, unit = planned.eagle3_head, role.eagle3_head
        head_entry: dict[str, Any] | None = None
        if head is not None and unit is not None:  # only then, likewise
            head_entry = {"unit": unit.unit, "graph": f"{unit.unit}/onnx/{card_graph_file(None)}",
                          "inputs": f"{unit.unit}/qaic",
                          "compile_script": f"{unit.unit}/qaic/compile.sh",
                          "compiler_args": head.compiler_argv[1:], "num_cores": unit.num_cores,
                          "device_group": unit.device_group,
                          "specializations": [s.model_dump() for s in unit.specializations],
                          "io": unit.io.to_dict()}
        if ctx.emit_only:
            if head_entry is not None:
                entry["eagle3_head"] = {**head_entry, "status": "emitted", "qpc": None}
            return {**entry, "status": "emitted", "qpc": None}
        compiler, tried = find_compiler(ctx.compiler)
        if compiler is None:
            raise ToolchainError(missing_compiler_message(tried))
        compiled = run_compiler(ctx, role.role, role.role, [compiler, *args])
        if head_entry is not None and head is not None:
            entry["eagle3_head"] = {**head_entry, **run_compiler(
                ctx, head_entry["unit"], "EAGLE-3 head", [compiler, *head.compiler_argv[1:]])}
        return {**entry, **compiled}


def run_compiler(ctx: BuildContext, unit: str, what: str, argv: list[str]) -> dict[str, Any]:
    """qaic-compile as planned for one unit (its folder `unit`), in the staging bundle; its
    entry's record of the QPC (ToolchainError naming `what` when the compile fails)."""
    log_dir = ctx.staging / unit / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "qaic-compile.log"
    with open(log, "wb") as fh:
        try:
            proc = subprocess.run(argv, cwd=ctx.staging, stdout=fh, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=os.environ.copy())
        except OSError as exc:
            raise ToolchainError(f"could not start {argv[0]}: {exc}") from None
    tail = log.read_text(errors="replace")[-2000:]
    qpc = ctx.staging / unit / "qpc" / QPC_FILE
    if proc.returncode != 0:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else \
            f"exit code {proc.returncode}"
        raise ToolchainError(f"qaic compile of the {what} failed ({how}). Command:\n  "
                             f"{shlex.join(argv)}\nLast output:\n{tail}")
    if not qpc.is_file():
        raise ToolchainError(f"the compiler exited 0 but wrote no {unit}/qpc/{QPC_FILE}."
                             f"\nLast output:\n{tail}")
    qpc_files = sorted(p.relative_to(ctx.staging).as_posix()
                       for p in (ctx.staging / unit / "qpc").rglob("*") if p.is_file())
    return {"status": "compiled", "qpc": f"{unit}/qpc", "qpc_files": qpc_files,
            "log": f"{unit}/logs/qaic-compile.log", "compiler": compiler_identity(argv[0])}


def write_unit_inputs(ctx: BuildContext, unit: str, planned: QaicPart,
                      specs: list[Specialization], n_devices: int, finish: str | None,
                      then: str | None = None) -> list[str]:
    """A unit's compiler inputs and compile.sh in `unit`/qaic/ (unit: a role, or an EAGLE-3
    head's folder). finish: the role whose QPCs the script records with `qpcbuild finish`
    (None: the script of a head, which its target's script runs before that role's finish);
    then: the unit whose compile.sh runs after this one's compile (the target's head)."""
    r = ctx.plan.recipe
    qdir = ctx.staging / unit / "qaic"
    qdir.mkdir(parents=True, exist_ok=True)
    spec = specializations_file(specs, r.hardware.specializations_format)
    (qdir / "specializations.json").write_text(json.dumps(spec, indent=2) + "\n")
    (qdir / "custom_io.yaml").write_text(custom_io_yaml(planned.custom_io))
    if planned.mdp_partition:
        (qdir / f"mdp_ts_{n_devices}.json").write_text(
            json.dumps(planned.mdp_partition, indent=2) + "\n")
    args = planned.compiler_argv[1:]
    what = f"the {unit} QPC" if finish else f"the EAGLE-3 head's QPC ({unit})"
    lines = ["#!/usr/bin/env bash",
             f"# Compile {what} for '{r.name}' on a machine with the Cloud AI SDK.",
             "# Runs from the bundle root; QAIC_COMPILER overrides the compiler path.",
             "set -euo pipefail",
             'cd "$(dirname "$0")/' + "/".join([".."] * (unit.count("/") + 2)) + '"',
             f'compiler="${{QAIC_COMPILER:-{QAIC_DEFAULT}}}"',
             f"mkdir -p {unit}/logs",
             f'"$compiler" {shlex.join(args)} 2>&1 | tee {unit}/logs/qaic-compile.log',
             f"test -s {unit}/qpc/{QPC_FILE} || {{ echo 'no {QPC_FILE} produced' >&2; exit 1; }}"]
    if then is not None:
        lines.append(f"bash {then}/qaic/compile.sh  # the EAGLE-3 head, recorded by this finish")
    if finish is None:
        lines.append(f"echo 'compiled {unit}/qpc; the compile.sh of the target records it (run "
                     "alone: qpcbuild finish <this bundle> --role target)' >&2")
    else:
        lines += ["# Record the QPC in the manifest (files, digests, SDK versions) and re-seal it.",
                  "if command -v qpcbuild >/dev/null 2>&1; then",
                  f'  qpcbuild finish . --role {finish} --compiler "$compiler"',
                  "else",
                  f"  echo 'compiled {unit}/qpc; now run: qpcbuild finish <this bundle>' >&2",
                  "fi"]
    script = qdir / "compile.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return args


QAIC_DEFAULT = "/opt/qti-aic/exec/qaic-compile"
BUILDER = QaicBackend

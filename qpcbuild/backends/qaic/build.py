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

from ...cache import META, Cache
from ...errors import BundleError, ToolchainError
from ...plan import RolePlan
from ...toolchain import compiler_identity, qaic_sdk_versions
from ...tree import copy_tree
from ...bundle.backend import BuildContext
from .kv_names import card_graph_file, is_kv_name, write_card_graph
from .manifest import NAME, QPC_FILE
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
            for part in ("qpc", "logs"):
                copy_tree(ctx.staging / role.role / part, tmp / role.role / part)
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
        r, planned = ctx.plan.recipe, self.part(role)
        qdir = ctx.staging / role.role / "qaic"
        qdir.mkdir(parents=True, exist_ok=True)
        spec = specializations_file(role.specializations, r.hardware.specializations_format)
        (qdir / "specializations.json").write_text(json.dumps(spec, indent=2) + "\n")
        (qdir / "custom_io.yaml").write_text(custom_io_yaml(planned.custom_io))
        if planned.kv_infix is not None:
            self.write_card_graph(ctx, role, planned)
        if planned.mdp_partition:
            (qdir / f"mdp_ts_{len(role.device_group)}.json").write_text(
                json.dumps(planned.mdp_partition, indent=2) + "\n")
        args = planned.compiler_argv[1:]
        script = qdir / "compile.sh"
        script.write_text(
            "#!/usr/bin/env bash\n"
            f"# Compile the {role.role} QPC for '{r.name}' on a machine with the Cloud AI SDK.\n"
            "# Runs from the bundle root; QAIC_COMPILER overrides the compiler path.\n"
            "set -euo pipefail\n"
            'cd "$(dirname "$0")/../.."\n'
            f'compiler="${{QAIC_COMPILER:-{QAIC_DEFAULT}}}"\n'
            f"mkdir -p {role.role}/logs\n"
            f'"$compiler" {shlex.join(args)} 2>&1 | tee {role.role}/logs/qaic-compile.log\n'
            f"test -s {role.role}/qpc/{QPC_FILE} || {{ echo 'no {QPC_FILE} produced' >&2; "
            "exit 1; }\n"
            "# Record the QPC in the manifest (files, digests, SDK versions) and re-seal it.\n"
            "if command -v qpcbuild >/dev/null 2>&1; then\n"
            f'  qpcbuild finish . --role {role.role} --compiler "$compiler"\n'
            "else\n"
            f"  echo 'compiled {role.role}/qpc; now run: qpcbuild finish <this bundle>' >&2\n"
            "fi\n")
        script.chmod(0o755)
        return args

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
        if ctx.emit_only:
            return {**entry, "status": "emitted", "qpc": None}
        compiler, tried = find_compiler(ctx.compiler)
        if compiler is None:
            raise ToolchainError(missing_compiler_message(tried))
        argv = [compiler, *args]
        log_dir = ctx.staging / role.role / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / "qaic-compile.log"
        with open(log, "wb") as fh:
            try:
                proc = subprocess.run(argv, cwd=ctx.staging, stdout=fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=os.environ.copy())
            except OSError as exc:
                raise ToolchainError(f"could not start {compiler}: {exc}") from None
        tail = log.read_text(errors="replace")[-2000:]
        qpc = ctx.staging / role.role / "qpc" / QPC_FILE
        if proc.returncode != 0:
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else \
                f"exit code {proc.returncode}"
            raise ToolchainError(f"qaic compile of the {role.role} failed ({how}). Command:\n  "
                                 f"{shlex.join(argv)}\nLast output:\n{tail}")
        if not qpc.is_file():
            raise ToolchainError(f"the compiler exited 0 but wrote no {role.role}/qpc/{QPC_FILE}."
                                 f"\nLast output:\n{tail}")
        qpc_files = sorted(p.relative_to(ctx.staging).as_posix()
                           for p in (ctx.staging / role.role / "qpc").rglob("*") if p.is_file())
        return {**entry, "status": "compiled", "qpc": f"{role.role}/qpc", "qpc_files": qpc_files,
                "log": f"{role.role}/logs/qaic-compile.log", "compiler": compiler_identity(compiler)}


QAIC_DEFAULT = "/opt/qti-aic/exec/qaic-compile"
BUILDER = QaicBackend

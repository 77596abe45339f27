"""The Qualcomm Cloud AI backend's planning: where the compiler is, its command line, the KV
buffers' precision (custom_io.yaml) and the multi-device partition (mdp_ts_N.json), the
compile's cache key and the warnings a card build earns. build.py writes the side files
and runs the command exactly as planned here."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from typing import Any

from ...errors import Problem, UsageError
from ...models.arch import ArchSpec
from ...models.specialization import Specialization
from ...recipe.schema import Recipe
from ...toolchain import executable
from ...backend_api import BackendPart, DeclaredIO, RoleFacts
from ...bundle.handoff import VLLM_KV_INFIX
from .kv_names import card_graph_file, card_kv_name

QAIC_COMPILERS = ("/opt/qti-aic/exec/qaic-compile", "/opt/qti-aic/exec/qaic-exec")
DEFAULT_COMPILER = "qaic-compile"  # argv[0] when none is found: compile.sh runs it from PATH


def find_compiler(explicit: str | None = None) -> tuple[str | None, list[str]]:
    """The Qualcomm compiler: --compiler, $QAIC_COMPILER (a path, or a name found on PATH), then
    the SDK's two known paths."""
    tried = []
    for candidate in (explicit, os.environ.get("QAIC_COMPILER"), *QAIC_COMPILERS):
        if not candidate:
            continue
        tried.append(candidate)
        try:
            return executable(candidate), tried
        except UsageError:
            continue
    return None, tried


def kv_buffers(io: DeclaredIO, infix: str | None = None) -> list[str]:
    """The KV cache's graph I/O names, from the declared I/O (each past input, then the output
    that retains it): the buffers whose precision the card's custom_io.yaml sets. infix: the
    name vllm-qaic gives them in a disaggregated unit (kv_names.py); None: as exported."""
    outputs = {e.name for e in io.outputs}
    names = []
    for e in io.inputs:
        if e.name.startswith("past_"):
            retained = f"{e.name}_RetainedState"
            names += [e.name] + ([retained] if retained in outputs else [])
    return names if infix is None else [card_kv_name(n, infix) for n in names]


def kv_infix(r: Recipe) -> str | None:
    """Every unit of a disaggregated bundle runs under vllm-qaic's kv_transfer_config, which
    names the KV buffers with this infix; an aggregated bundle keeps the exported names."""
    return VLLM_KV_INFIX if r.disaggregated is not None else None


def mdp_partition(devices: list[int], cores: int) -> dict[str, Any] | None:
    if len(devices) < 2:
        return None
    n = len(devices)  # logical ids 0..n-1; physical QIDs are bound when the QPC is loaded
    return {"connections": [{"devices": list(range(n)), "type": "p2p"}],
            "partitions": [{"name": "Partition0",
                            "devices": [{"deviceId": d, "numCores": cores} for d in range(n)]}]}


def compiler_argv(role: str, r: Recipe, cores: int, n_devices: int, compiler: str,
                  graph_role: str | None = None) -> list[str]:
    """graph_role: whose exported graph the unit compiles, where it is not `role`'s own (a
    disaggregated prefill unit compiles the target's); a disaggregated unit compiles its copy
    with vllm-qaic's KV names (kv_names.py)."""
    opts, q = r.hardware.compiler_options, f"{role}/qaic"
    # QEfficient passes -convert-to-fp16 whenever its graph is not bfloat16; its graph is
    # bfloat16 only for a bf16 checkpoint on ai200. The card graph here always computes in
    # float32 (float16 weights are Cast up), so the flag is always QEfficient's choice for it.
    graph = f"{graph_role or role}/onnx/{card_graph_file(kv_infix(r))}"
    argv = [compiler, "-aic-hw", f"-aic-hw-version={r.hardware.aic_hw_version}", f"-m={graph}",
            "-retained-state", "-convert-to-fp16"]
    if r.precision.quantization == "mxfp6":
        argv.append("-mxfp6-matmul")
    argv.append(f"-aic-num-cores={cores}")
    if opts.aic_enable_depth_first:
        argv.append("-aic-enable-depth-first")
    if opts.mos is not None:
        argv.append(f"-mos={opts.mos}")
    if opts.allow_mxint8_mdp_io:
        argv.append("-allow-mxint8-mdp-io")
    argv += list(opts.extra_flags)
    if n_devices > 1:
        argv.append(f"-mdp-load-partition-config={q}/mdp_ts_{n_devices}.json")
    argv += [f"-network-specialization-config={q}/specializations.json",
             f"-custom-IO-list-file={q}/custom_io.yaml", f"-aic-binary-dir={role}/qpc"]
    return argv


def specializations_file(specs: list[Specialization], fmt: str) -> dict[str, Any]:
    """specializations.json for qaic-compile: QEfficient's named entries, or the flat form
    (each entry's symbols only) that older SDKs read."""
    if fmt == "flat":
        return {"specializations": [s.symbols for s in specs]}
    return {"specializations": [s.model_dump() for s in specs]}


def custom_io_yaml(custom_io: list[dict[str, str]]) -> str:
    """custom_io.yaml: the precision of each KV input and its retained-state output."""
    return "".join(f" - IOName: {e['IOName']}\n   Precision: {e['Precision']}\n\n"
                   for e in custom_io)


@dataclass(frozen=True)
class QaicPart(BackendPart):
    """The role's compile for the card as planned: the compiler's side files and command."""
    custom_io: list[dict[str, str]]  # custom_io.yaml's rows: {"IOName", "Precision"}
    mdp_partition: dict[str, Any] | None  # mdp_ts_N.json (None: one device)
    compiler_argv: list[str]  # relative to the bundle root; argv[0] is the compiler
    # vllm-qaic's KV name infix in the compiled graph and custom_io (None: the exported names)
    kv_infix: str | None = None
    # A target's EAGLE-3 head compiled beside it: its own compile, planned as a unit's
    # (its folder backend_api.EAGLE3_HEAD_UNIT); None: no head on the card
    eagle3_head: QaicPart | None = None

    def to_dict(self) -> dict[str, Any]:
        shown = {**super().to_dict(), "compiler_command": shlex.join(self.compiler_argv)}
        if self.kv_infix is None:
            del shown["kv_infix"]  # an aggregated plan shows what it always did
        if self.eagle3_head is None:
            del shown["eagle3_head"]  # so does a plan without a head
        else:
            shown["eagle3_head"] = self.eagle3_head.to_dict()
        return shown

    def describe(self, r: Recipe, n_devices: int, built: bool) -> list[str]:
        first = ", ".join(e["IOName"] for e in self.custom_io[:2])
        lines = [f"custom_io.yaml: {len(self.custom_io)} entries, Precision "
                 f"{self.custom_io[0]['Precision']} ({first}, ...)"]
        if self.mdp_partition:
            lines.append(f"mdp_ts_{n_devices}.json: "
                         f"{json.dumps(self.mdp_partition, separators=(',', ':'))}")
        if built:
            lines.append(f"[bold]qaic compile[/] (cwd = bundle root):\n  "
                         f"{shlex.join(self.compiler_argv)}")
        head = self.eagle3_head
        if head is not None:
            lines.append(f"EAGLE-3 head: its own compile, custom_io.yaml {len(head.custom_io)} "
                         f"entries ({', '.join(e['IOName'] for e in head.custom_io)})")
            if built:
                lines.append(f"[bold]qaic compile of the EAGLE-3 head[/] (cwd = bundle root):"
                             f"\n  {shlex.join(head.compiler_argv)}")
        return lines

    def manifest_role_fields(self) -> dict[str, Any]:
        return {"mdp_partition": self.mdp_partition}


class QaicPlan:
    def plan_role(self, r: Recipe, facts: RoleFacts, compiler: str | None) -> QaicPart:
        compiler = compiler or find_compiler()[0] or DEFAULT_COMPILER
        infix = kv_infix(r)
        return QaicPart(
            eagle3_head=self.plan_role(r, facts.head, compiler) if facts.head else None,
            custom_io=[{"IOName": n, "Precision": r.precision.kv_cache_dtype}
                       for n in kv_buffers(facts.io, infix)],
            mdp_partition=mdp_partition(facts.device_group, facts.cores),
            compiler_argv=compiler_argv(facts.role, r, facts.cores, len(facts.device_group),
                                        compiler, facts.model_role),
            kv_infix=infix)

    def settings(self, r: Recipe, facts: RoleFacts, part: QaicPart) -> dict[str, Any]:
        # argv[0] is left out: where the compiler is installed does not change the program
        settings: dict[str, Any] = {
            "export": facts.export_key, "argv": part.compiler_argv[1:],
            "specs": [s.model_dump() for s in facts.specializations],
            "custom_io": r.precision.kv_cache_dtype, "fmt": r.hardware.specializations_format}
        # only where set: an aggregated unit's key (and so its bundle id) is as before
        if part.kv_infix is not None:
            settings["kv_infix"] = part.kv_infix
        if facts.head is not None and part.eagle3_head is not None:  # likewise
            settings["eagle3_head"] = self.settings(r, facts.head, part.eagle3_head)
        return settings

    def problems(self, r: Recipe, role: str, arch: ArchSpec) -> list[Problem]:
        return []  # the card compiles whatever the exporter writes

    def warnings(self, r: Recipe, configs: dict[str, dict[str, Any]]) -> list[str]:
        out = []
        if r.precision.export_dtype == "float16":
            out.append("qaic: export_dtype float16 Casts each stored weight up to float32 in "
                       "front of its MatMul, a form QEfficient's graphs never have (`qpcbuild "
                       "doctor` flags it; whether -mxfp6-matmul compresses such weights is "
                       "unknown): prefer float32 for a card bundle")
        if r.hardware.aic_hw_version == "ai200":
            for role, config in configs.items():
                if (config.get("torch_dtype") or config.get("dtype")) == "bfloat16":
                    out.append(f"{role}: a bfloat16 checkpoint on ai200 runs in bfloat16 under "
                               "QEfficient (no -convert-to-fp16, bfloat16 KV); this bundle's "
                               "graph is its exact float32 upcast, compiled to float16 as "
                               "QEfficient compiles float32 checkpoints")
        return out


PLAN = QaicPlan()

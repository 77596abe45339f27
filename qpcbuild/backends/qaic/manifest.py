"""The Qualcomm Cloud AI backend's manifest entry: its compiler inputs, and once compiled (here
or by `qpcbuild finish`) its QPC."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

from ...backend_api import BackendEntry
from ...models.specialization import Specialization
from .kv_names import RETAINED, card_kv_name, is_kv_name

NAME = "qaic"  # the registry's name for this backend (`finish` adopts its QPCs)
QPC_FILE = "programqpc.bin"
ADOPTED = ("qpc", "logs")  # what compile.sh writes under each role, for `finish` to adopt


def compiled_units(role: str, head: Any) -> list[str]:
    """The folders whose qpc/ and logs/ a role's compile writes: its own, and its EAGLE-3
    head's (`head`: the plan's or the manifest's record of it, None without one)."""
    return [role] + ([head.unit] if head is not None else [])


class QaicHeadEntry(BaseModel):
    """A target's EAGLE-3 head compiled for the card beside it (export/eagle3_card.py): its
    unit's folder, card graph, compiler inputs and, once compiled, its QPC. The target's
    compile.sh runs the head's, and `finish --role target` records both."""
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    status: Literal["emitted", "compiled"]
    unit: str  # the folder holding onnx/, qaic/, qpc/ and logs/ (backend_api.EAGLE3_HEAD_UNIT)
    graph: str
    inputs: str
    compile_script: str
    compiler_args: list[str]
    num_cores: int
    device_group: list[int]
    specializations: list[Specialization]
    io: dict[str, list[dict[str, Any]]]  # the head graph's inputs and outputs (graph_io form)
    qpc: Optional[str] = None
    qpc_files: Optional[list[str]] = None
    log: Optional[str] = None


class QaicEntry(BackendEntry):
    status: Literal["emitted", "compiled"]
    inputs: Optional[str] = None  # the folder of compiler inputs (specializations, custom I/O)
    compile_script: Optional[str] = None
    compiler_args: list[str] = []
    qpc: Optional[str] = None
    qpc_files: Optional[list[str]] = None
    log: Optional[str] = None
    # A disaggregated unit (kv_names.py): the graph it compiles, with vllm-qaic's KV names,
    # and those names as its custom_io.yaml lists them. Absent: the exported graph and names.
    graph: Optional[str] = None
    kv_infix: Optional[str] = None
    kv_buffers: Optional[list[str]] = None
    eagle3_head: Optional[QaicHeadEntry] = None  # a target's EAGLE-3 head, compiled beside it

    def problems(self, role: dict[str, Any]) -> list[str]:
        out = []
        if self.status == "compiled" and not self.qpc:
            out.append("backends.qaic: compiled, but names no qpc")
        head = self.eagle3_head
        if head is not None and head.status != self.status:
            out.append(f"backends.qaic.eagle3_head: {head.status}, but the target's QPC is "
                       f"{self.status} (one compile.sh and one finish record both)")
        if head is not None and head.status == "compiled" and not head.qpc:
            out.append("backends.qaic.eagle3_head: compiled, but names no qpc")
        if (self.kv_infix is None) != (self.kv_buffers is None):
            out.append("backends.qaic: kv_infix and kv_buffers are recorded together")
        elif self.kv_infix is not None and self.kv_buffers is not None:
            io = role.get("io", {})
            outputs = {e["name"] for e in io.get("outputs", [])}
            exported = []
            for e in io.get("inputs", []):
                if is_kv_name(e["name"]):
                    retained = e["name"] + RETAINED
                    exported += [e["name"]] + ([retained] if retained in outputs else [])
            want = [card_kv_name(n, self.kv_infix) for n in exported]
            if self.kv_buffers != want:
                wrong = next((f"{a!r} (expected {b!r})" for a, b in
                              zip(self.kv_buffers, want) if a != b),
                             f"{len(self.kv_buffers)} names, expected {len(want)}")
                out.append(f"backends.qaic.kv_buffers: {wrong} is not the role's KV I/O "
                           f"named with the infix {self.kv_infix!r}")
        return out

    def unit_graphs(self) -> dict[str, tuple[str, dict[str, Any]]]:
        head = self.eagle3_head
        return {} if head is None else {head.unit: (head.graph, head.io)}

    def device_kv_buffers(self) -> list[str] | None:
        if self.kv_buffers is None:
            return None
        return [n for n in self.kv_buffers if not n.endswith(RETAINED)]


ENTRY = QaicEntry

"""The Qualcomm Cloud AI backend's manifest entry: its compiler inputs, and once compiled (here
or by `qpcbuild finish`) its QPC."""

from __future__ import annotations

from typing import Any, Literal, Optional

from ...backend_api import BackendEntry

NAME = "qaic"  # the registry's name for this backend (`finish` adopts its QPCs)
QPC_FILE = "programqpc.bin"
ADOPTED = ("qpc", "logs")  # what compile.sh writes under each role, for `finish` to adopt


class QaicEntry(BackendEntry):
    status: Literal["emitted", "compiled"]
    inputs: Optional[str] = None  # the folder of compiler inputs (specializations, custom I/O)
    compile_script: Optional[str] = None
    compiler_args: list[str] = []
    qpc: Optional[str] = None
    qpc_files: Optional[list[str]] = None
    log: Optional[str] = None


    def problems(self, role: dict[str, Any]) -> list[str]:
        if self.status == "compiled" and not self.qpc:
            return ["backends.qaic: compiled, but names no qpc"]
        return []


ENTRY = QaicEntry

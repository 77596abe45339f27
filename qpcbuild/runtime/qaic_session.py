"""A model session on a Cloud AI 100 card through Qualcomm's `qaicrt` Python runtime.

It mirrors the ONNX Runtime session: the KV buffers are retained state that never leaves the
device (the host binds zero-sized buffers for them), and the specialization is chosen by the
shapes of the buffers passed in. Written from the public usage in QEfficient's session; it needs
the Cloud AI apps SDK, which no package registry provides, so it is not exercised by our CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ToolchainError
from .model_session import Specialization, pick_specialization

SDK_PYTHON = "/opt/qti-aic/dev/lib/x86_64"  # where the SDK installs qaicrt and aicapi


def _import_runtime() -> tuple[Any, Any]:
    """(qaicrt, aicapi): the SDK's modules, untyped (they ship no type information)."""
    import sys

    if SDK_PYTHON not in sys.path:
        sys.path.append(SDK_PYTHON)
    try:
        import qaicrt  # type: ignore
        from QAicApi_pb2 import aicapi  # type: ignore  # IO descriptor protobuf, from the SDK
    except ImportError as exc:
        raise ToolchainError(
            f"the Cloud AI runtime (qaicrt) is not importable ({exc}). Install the Cloud AI "
            f"apps SDK (it provides qaicrt under {SDK_PYTHON}) or run with --backend "
            "onnxruntime") from None
    return qaicrt, aicapi


class QaicSession:
    def __init__(self, qpc_dir: Path, role: str, specs: list[Specialization],
                 device_group: list[int], num_layers: int, vocab_size: int):
        qaicrt, aicapi = _import_runtime()
        qpc_file = Path(qpc_dir) / "programqpc.bin"
        if not qpc_file.is_file():
            raise ToolchainError(f"{qpc_file} is missing")
        self.role, self.specializations, self.vocab_size = role, specs, vocab_size
        self.batch_size = max(s.batch_size for s in specs)  # decode batch (slots with CB)
        self.ctx_len = specs[0].ctx_len
        self.min_window = self.window_step = 1  # the card's compiled windows are what they are
        devices = qaicrt.QIDList(list(device_group))
        self._context = qaicrt.Context(devices)
        self._queue = qaicrt.Queue(self._context, device_group[0])
        qpc = qaicrt.Qpc(str(qpc_dir))
        iodesc = aicapi.IoDesc()
        iodesc.ParseFromString(bytes(qpc.getIoDescriptor()))
        self._bindings = list(iodesc.selected_set.bindings)
        self._index = {b.name: b.index for b in self._bindings}
        props = qaicrt.QAicProgramProperties()
        if len(device_group) > 1:  # one program over several QIDs (tensor slicing)
            props.devMapping = ":".join(str(d) for d in device_group)
        self._program = qaicrt.Program(self._context, None, qpc, props)
        if self._program.load() != qaicrt.QStatus.QS_SUCCESS or \
                self._program.activate() != qaicrt.QStatus.QS_SUCCESS:
            raise ToolchainError(f"could not load/activate {qpc_file} on devices {device_group}")
        self._exec = qaicrt.ExecObj(self._context, self._program)
        self._qaicrt = qaicrt
        self._dtypes = {b.name: np.dtype(np.int64) if "ids" in b.name or b.name in
                        ("num_logits_to_keep", "batch_index") else np.dtype(np.float32)
                        for b in self._bindings}
        # Retained state stays on the card: bind empty host buffers for every KV tensor.
        self._buffers = [qaicrt.QBuffer(bytes(0)) for _ in self._bindings]
        self._dims = [(self._dtypes[b.name].itemsize, [0]) for b in self._bindings]

    def _set(self, name: str, array: np.ndarray) -> None:
        i = self._index[name]
        self._buffers[i] = self._qaicrt.QBuffer(np.ascontiguousarray(array).tobytes())
        self._dims[i] = (array.dtype.itemsize, list(array.shape))

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray,
            batch_index: np.ndarray | None = None) -> np.ndarray:
        spec = pick_specialization(self.specializations, *input_ids.shape)
        self._set("input_ids", input_ids.astype(np.int64))
        self._set("position_ids", position_ids.astype(np.int64))
        if batch_index is not None and "batch_index" in self._index:
            self._set("batch_index", batch_index.astype(np.int64))
        if "num_logits_to_keep" in self._index:
            self._set("num_logits_to_keep", np.zeros((spec.num_logits, 1), np.int64))
        # The output placeholder's shape is what selects the specialization on the card.
        logits = np.zeros((spec.batch_size, spec.num_logits, self.vocab_size), np.float32)
        self._set("logits", logits)
        self._exec.setData(self._buffers, self._qaicrt.BufferDimensionsVecRef(self._dims))
        self._queue.enqueue(self._exec)
        if self._exec.waitForCompletion() != self._qaicrt.QStatus.QS_SUCCESS:
            raise ToolchainError(f"{self.role} execution failed on the card")
        _, outputs = self._exec.getData()
        raw = bytes(outputs[self._index["logits"]])
        return np.frombuffer(raw, np.float32).reshape(logits.shape)

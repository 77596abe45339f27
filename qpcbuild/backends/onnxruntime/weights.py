"""An exported portable graph's weights, read back tensor by tensor for the ONNX Runtime lowering
(ort_graph.py), and given back to the disk as they are lowered when the graph is a scratch copy."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...errors import QpcbuildError
from ...tree import free_range


class PortableWeights:
    """Tensors of an exported portable graph, read back from its external data file.

    `spend`: the graph is a scratch copy that nothing reads after this lowering (a build
    without a cache). release() then gives each layer's bytes back to the disk once the layer
    is lowered, and the export and the artifact never both hold every layer (the float32
    Qwen2.5-Coder pair's build: 8.3 GiB of disk at the peak instead of 12.6)."""

    def __init__(self, onnx_path: Path, spend: bool = False):
        model = onnx.load(str(onnx_path), load_external_data=False)
        self.dir = onnx_path.parent
        self.spend = spend
        self.released: set[str] = set()
        self.entries = {}
        for t in model.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                info = {e.key: e.value for e in t.external_data}
                self.entries[t.name] = (info["location"], int(info.get("offset", 0)),
                                        int(info["length"]), t.data_type, tuple(t.dims))

    def release(self, names: list[str]) -> None:
        """Done with these tensors: with `spend`, their bytes are freed; reading one again is
        then an error, never the zeros a freed range holds."""
        if not self.spend:
            return
        files: dict[str, int] = {}
        try:
            for name in names:
                location, offset, length = self.entries[name][:3]
                if location not in files:
                    files[location] = os.open(self.dir / location, os.O_WRONLY)
                free_range(files[location], offset, length)
                self.released.add(name)
        finally:
            for fd in files.values():
                os.close(fd)

    def get(self, name: str) -> np.ndarray:
        if name in self.released:
            raise QpcbuildError(f"internal error: the ONNX Runtime lowering read '{name}' again "
                                "after releasing it; rebuild with a cache (no --no-cache)")
        location, offset, length, dtype, dims = self.entries[name]
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        with open(self.dir / location, "rb") as fh:
            fh.seek(offset)
            arr = np.frombuffer(fh.read(length), dtype=np_dtype).reshape(dims)
        return arr.astype(np.float32) if arr.dtype.kind == "f" else arr  # float16 exports too

    def has(self, name: str) -> bool:
        return name in self.entries

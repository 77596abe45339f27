"""Map safetensors tensors one at a time, straight from the file, with every header checked.

We parse the format ourselves (8-byte header length, JSON header, raw little-endian data) so that
bfloat16 needs no framework, a truncated shard is caught before any byte is trusted, and no
tensor is ever copied whole into memory, whatever the model's size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError

DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}
MAX_HEADER = 100 << 20
CHECK_CHUNK = 1 << 23


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    length: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise UsageError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER or 8 + n > size:
            raise UsageError(f"{path}: corrupt or truncated safetensors header "
                             f"(header length {n}, file size {size})")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise UsageError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise UsageError(f"{path}: corrupt safetensors header (a JSON object of tensors "
                         f"expected, got a {type(header).__name__})")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in meta["data_offsets"])
            dtype, shape = str(meta["dtype"]), tuple(int(d) for d in meta["shape"])
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{path}: malformed header entry for tensor '{name}'") from None
        if 8 + n + end > size or begin > end:
            raise UsageError(f"{path}: tensor '{name}' lies beyond the end of the file "
                             f"(file is {size} bytes): the shard is truncated")
        out[name] = TensorInfo(path, dtype, shape, 8 + n + begin, end - begin)
    return out


class WeightReader:
    """All tensors of a checkpoint by name; `stored` maps one at a time."""

    def __init__(self, files: list[Path], allow_pickle: bool = False):
        self.tensors: dict[str, TensorInfo] = {}
        self.pickled: dict = {}  # name -> torch tensor, only for opted-in pickle checkpoints
        for f in files:
            if f.suffix == ".safetensors":
                self.tensors.update(read_header(f))
            elif allow_pickle:
                self.pickled.update(_load_pickle(f))
            else:
                raise UsageError(f"{f}: pickle checkpoints can run code when loaded; convert to "
                                 "safetensors or opt in with allow_pickle: true")
        self.files = files

    def has(self, name: str) -> bool:
        return name in self.tensors or name in self.pickled

    def _checked(self, name: str, expected_shape: tuple[int, ...]) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            names = ", ".join(f.name for f in self.files)
            raise UsageError(f"tensor '{name}' is missing from the checkpoint ({names})")
        if info.dtype not in DTYPES:
            raise UsageError(f"{info.file}: tensor '{name}' has dtype {info.dtype}; supported: "
                             f"{', '.join(DTYPES)}")
        if info.shape != tuple(expected_shape):
            raise UsageError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, the "
                             f"config implies {list(expected_shape)}")
        itemsize = DTYPES[info.dtype][1]
        if info.length != itemsize * int(np.prod(info.shape, dtype=np.int64)):
            raise UsageError(f"{info.file}: tensor '{name}' byte length {info.length} does not "
                             f"match its shape and dtype")
        return info

    def stored(self, name: str, expected_shape: tuple[int, ...]) -> StoredTensor:
        """The tensor as stored, memory-mapped: nothing is read until it is used, and a
        multi-GB embedding never needs a second copy in memory."""
        if name in self.pickled:
            t = self.pickled[name]
            if tuple(t.shape) != tuple(expected_shape):
                raise UsageError(f"tensor '{name}' has shape {list(t.shape)}, the config implies "
                                 f"{list(expected_shape)}")
            if not t.is_floating_point():
                raise UsageError(f"tensor '{name}' has dtype {t.dtype}; floating point expected")
            import torch
            raw = t.contiguous().view(-1).view(torch.uint8).numpy()
            return StoredTensor(t.to(torch.float32).numpy(), "F32",
                                hashlib.sha256(memoryview(raw)).hexdigest())
        info = self._checked(name, expected_shape)
        if info.length == 0:  # mmap cannot map nothing
            values = np.zeros(info.shape, DTYPES[info.dtype][0])
        else:
            values = np.memmap(info.file, dtype=np.dtype(DTYPES[info.dtype][0]).newbyteorder("<"),
                               mode="r", offset=info.start, shape=info.shape)
        return StoredTensor(values, info.dtype, hashlib.sha256(memoryview(values)).hexdigest())


@dataclass(frozen=True)
class StoredTensor:
    """A tensor's stored values (bfloat16 as its raw uint16 bits), the digest of its bytes,
    and how to turn any slice of it into float32."""
    values: np.ndarray
    dtype: str  # "F32" | "F16" | "BF16"
    sha256: str

    def widen(self, part: np.ndarray) -> np.ndarray:
        if self.dtype == "BF16":  # bfloat16 is the top half of a float32
            wide = part.astype(np.uint32)
            wide <<= 16
            return wide.view(np.float32)
        return part.astype(np.float32, copy=False)

    def non_finite(self) -> bool:
        """NaN or inf anywhere, read from the exponent bits in bounded chunks."""
        bits, mask = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00),
                      "F32": (np.uint32, 0x7F800000)}[self.dtype]
        flat = self.values.reshape(-1).view(bits)
        for start in range(0, flat.size, CHECK_CHUNK):
            if ((flat[start:start + CHECK_CHUNK] & mask) == mask).any():
                return True
        return False


def _load_pickle(path: Path) -> dict:
    """An opted-in .bin/.pt checkpoint, through torch's restricted (weights-only) unpickler."""
    try:
        import torch
    except ImportError:
        raise UsageError(f"{path}: reading a pickle checkpoint needs torch (pip install "
                         "torch==2.13.0), or convert it to safetensors") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for corrupt or unsafe files
        raise UsageError(f"{path}: cannot read as a weights-only pickle checkpoint ({exc})") from None
    if not isinstance(state, dict):
        raise UsageError(f"{path}: expected a state dict of tensors")
    return state

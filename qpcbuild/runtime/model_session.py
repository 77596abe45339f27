"""What every model session shares (the ONNX Runtime session, session.py, and the Cloud AI
one, qaic_session.py): the interface the decode loop drives and the compiled specializations it
picks from. A module of its own so the two sessions need not know each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from ..errors import UsageError

if TYPE_CHECKING:  # only its type: the loader hands the entries over
    from ..models.specialization import Specialization as ManifestSpecialization


@dataclass(frozen=True)
class Specialization:
    name: str
    batch_size: int
    seq_len: int
    ctx_len: int
    num_logits: int  # logits rows returned: num_logits_to_keep (target) or 1

    @classmethod
    def from_manifest(cls, entry: ManifestSpecialization) -> "Specialization":
        """From a manifest's (models.specialization.Specialization) symbols."""
        return cls(entry.name, entry.size("batch_size"), entry.size("seq_len"),
                   entry.size("ctx_len"), int(entry.symbols.get("num_logits_to_keep", 1)))


class ModelSession(Protocol):
    role: str
    batch_size: int
    ctx_len: int
    vocab_size: int
    specializations: list[Specialization]
    # the fewest tokens a call carries: the engine pads a lone token's window to it (2 for an
    # int8/int4 ONNX Runtime target, whose logits would otherwise depend on the window)
    min_window: int

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray,
            batch_index: np.ndarray | None = None) -> np.ndarray:
        """[B,S] int64 each (+ [B,1] KV slots with continuous batching) -> logits
        [B, num_logits, V], valid until the next call."""


def floor_windows(specs: list[Specialization], min_window: int) -> list[Specialization]:
    """The windows of `min_window` tokens that a session with that floor runs in place of
    narrower compiled ones (one per batch size that has a narrower window and not that one).
    Such a window keeps the logits rows the narrower ones keep (1 for a lone token: the LM
    head does not compute the padding's), ending at the last real token."""
    have = {(s.batch_size, s.seq_len) for s in specs}
    extra: dict[int, Specialization] = {}
    for s in specs:
        if s.seq_len < min_window and (s.batch_size, min_window) not in have:
            rows = max(s.num_logits, extra[s.batch_size].num_logits) \
                if s.batch_size in extra else s.num_logits
            extra[s.batch_size] = Specialization(f"Window_{min_window}", s.batch_size,
                                                 min_window, s.ctx_len, rows)
    return list(extra.values())


@runtime_checkable
class HeadsSession(Protocol):
    """A target with turbo heads compiled in (export/turbo.py): `run` returns the base model's
    logits, and this the heads' of the same call."""
    heads: int

    def head_logits(self) -> np.ndarray:
        """[B, num_logits, heads, V] of the last `run`, valid until the next call."""


FEATURES = "eagle3_hidden"  # the target graph's output an EAGLE-3 head reads (export/eagle3.py)


@runtime_checkable
class FeatureSession(Protocol):
    """A target that returns an EAGLE-3 head's input feature at every position of a call."""
    feature_size: int  # H; 0: this graph returns none

    def features(self) -> np.ndarray:
        """[B, S, H] of the last `run`, valid until the next call."""


def pick_specialization(specs: list[Specialization], batch: int, seq_len: int) -> Specialization:
    for s in specs:
        if s.batch_size == batch and s.seq_len == seq_len:
            return s
    have = ", ".join(f"{s.name}(batch {s.batch_size}, seq_len {s.seq_len})" for s in specs)
    raise UsageError(f"no compiled specialization for batch {batch}, seq_len {seq_len}; "
                     f"this bundle has: {have}")

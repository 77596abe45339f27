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
    # int8/int4 ONNX Runtime target, whose logits would otherwise depend on the window); and
    # a multiple every window is padded to (2 for such a target in blocks longer than 32)
    min_window: int
    window_step: int

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray,
            batch_index: np.ndarray | None = None) -> np.ndarray:
        """[B,S] int64 each (+ [B,1] KV slots with continuous batching) -> logits
        [B, num_logits, V], valid until the next call."""


def _round_up(n: int, floor: int, step: int) -> int:
    """n raised to at least `floor`, then to a multiple of `step`."""
    return -(-max(n, floor) // step) * step


def padded_window(session: object, seq_len: int) -> int:
    """The window a call of `seq_len` tokens goes through on `session`: at least its
    `min_window`, rounded up to a multiple of its `window_step` (sessions that say neither: the
    call's own). An int8/int4 ONNX Runtime target needs both for a token's logits not to depend
    on the window it comes in (nbits.TARGET_NBITS)."""
    return _round_up(seq_len, int(getattr(session, "min_window", 1)),
                     int(getattr(session, "window_step", 1)))


def padded_windows(specs: list[Specialization], min_window: int, step: int = 1
                   ) -> list[Specialization]:
    """The windows a session with that floor and step runs in place of compiled ones it may
    not run as they are (one per batch size and width, where that width is not compiled).
    Such a window keeps the logits rows of the widest compiled window it stands for (1 for a
    lone token: the LM head does not compute the padding's), ending at the last real token,
    also rounded up to the step (the LM head's call carries those rows; a kept padding row is
    never read)."""
    have = {(s.batch_size, s.seq_len) for s in specs}
    extra: dict[tuple[int, int], Specialization] = {}
    for s in specs:
        width = _round_up(s.seq_len, min_window, step)
        key = (s.batch_size, width)
        if width == s.seq_len or key in have:
            continue
        rows = _round_up(s.num_logits, 1, step)
        rows = max(rows, extra[key].num_logits) if key in extra else rows
        extra[key] = Specialization(f"Window_{width}", s.batch_size, width, s.ctx_len, rows)
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

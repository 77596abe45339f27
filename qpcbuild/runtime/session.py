"""Model sessions: one compiled model with its KV cache kept where the model runs.

The decode loop sees only `run(input_ids, position_ids) -> logits`. As on the card, the KV
buffers never travel through the loop: the ONNX Runtime session keeps two pre-allocated sets and
binds them ping-pong (inputs from one, `_RetainedState` outputs into the other), so no step copies
the cache in Python. Only the specializations compiled into the bundle are accepted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, TypeVar

import numpy as np

from ..errors import BundleError
from ..ort_threads import pool_threads, session_options
from .model_session import ModelSession, Specialization, pick_specialization  # noqa: F401  (re-exported)
from .model_session import FEATURES, padded_windows

REMEASURE = 64  # single-token calls between re-timings of the way not taken (RowwiseOrtSession)
# ONNX Runtime ships no type information: its sessions, values and bindings are Any here.
KVShape = tuple[int, int, int, int]  # (rows, KV heads, ctx_len, head_dim)
CallShape = tuple[int, int]  # (batch, seq_len) of one call
Entry = TypeVar("Entry")


class Bound(NamedTuple):
    """One specialization's host arrays, their ORT values and the call's bindings (two when
    the KV sets ping-pong)."""
    spec: Specialization
    arrays: dict[str, np.ndarray]
    values: dict[str, Any]
    bindings: list[Any]


class RowsBound(NamedTuple):
    """RowwiseOrtSession's specialization: its host arrays, the bindings of (row, slot) made
    when first used, and one binding of every row together (None where the graph has no
    symbolic batch or the call is not single-token over every row)."""
    arrays: dict[str, np.ndarray]
    made: dict[tuple[int, int], Any]
    together: Any | None


def check_graph_io(sess: Any, path: Path, role: str, kv_shape: tuple[int, ...],
                   num_layers: int, vocab_size: int) -> None:
    """The graph must be the one the manifest describes: one KV pair per layer, KV and logits
    dimensions equal to the manifest's wherever the graph fixes them. A re-sealed manifest that
    swapped artifacts or edited a size fails here, not in the middle of a decode step."""
    inputs = {i.name: i.shape for i in sess.get_inputs()}
    outputs = {o.name: o.shape for o in sess.get_outputs()}
    layers = sum(1 for name in inputs if name.startswith("past_key."))
    problems = []
    if layers != num_layers:
        problems.append(f"{layers} KV layers, the manifest says num_layers {num_layers}")
    for name in ("input_ids", "position_ids"):
        if name not in inputs:
            problems.append(f"no {name} input")
    for name, shape in inputs.items():
        if name.startswith("past_") and len(shape) == 4:
            fixed = [(d, want) for d, want in zip(shape, kv_shape) if isinstance(d, int)]
            if any(d != want for d, want in fixed):
                problems.append(f"{name} has shape {shape}, the manifest says {list(kv_shape)}")
                break
    logits = outputs.get("logits")
    if logits is None or (isinstance(logits[-1], int) and logits[-1] != vocab_size):
        problems.append(f"logits {logits}, the manifest says vocab_size {vocab_size}")
    if problems:
        raise BundleError(f"{path}: the {role} graph does not match the manifest: "
                          + "; ".join(problems[:3]))


class OrtSession:
    def __init__(self, path: Path, role: str, specs: list[Specialization], kv_shape: KVShape,
                 num_layers: int, vocab_size: int, threads: int | None = None,
                 in_place: bool = False, min_window: int = 1, heads: int = 0,
                 window_step: int = 1):
        """threads: the recipe's `onnxruntime.intra_op_threads`; None: every CPU (see
        ort_threads for how the two roles share them). min_window: the fewest tokens a call
        must carry (the engine pads a lone token to it), window_step: a multiple every call's
        window is padded to; such windows are bound beside the compiled ones (the fused
        graph's seq_len is symbolic). heads: turbo heads compiled
        into the logits (their [.., heads + 1, V] axis: `run` returns index 0, `head_logits`
        the rest)."""
        self.path, self.role = Path(path), role
        self.min_window, self.window_step = min_window, window_step
        self.specializations = specs + padded_windows(specs, min_window, window_step)
        self.heads = heads
        self._last_logits: np.ndarray | None = None
        self._last_features: np.ndarray | None = None
        self.feature_size = 0
        self._threads_option, self._in_place = threads, in_place
        self.threads = pool_threads(threads)
        self.batch_size, self.ctx_len, self.vocab_size = kv_shape[0], kv_shape[2], vocab_size
        self._kv_names = [f"past_{k}.{i}" for i in range(num_layers) for k in ("key", "value")]
        # In place (fused graph): each KV input and its _RetainedState output share one buffer.
        # Ping-pong (portable graph, whose ScatterND copies input to output): two sets.
        sides = 1 if in_place else 2
        self.kv_buffers = [[np.zeros(kv_shape, np.float32) for _ in self._kv_names]
                           for _ in range(sides)]
        self._kv_shape, self._num_layers = kv_shape, num_layers
        self._open()

    def _open(self) -> None:
        """Load the artifact and bind every specialization's buffers (the KV buffers persist)."""
        import onnxruntime as ort

        self._load(self._kv_shape)
        kv = [[ort.OrtValue.ortvalue_from_numpy(b) for b in side] for side in self.kv_buffers]
        self._bound: dict[CallShape, Bound] = {}
        for spec in self.specializations:
            arrays = self._arrays(spec)
            values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in arrays.items()}
            inputs = {k: v for k, v in values.items() if k not in ("logits", FEATURES)}
            bindings = [self._binding(inputs, kv[src], kv[dst], values["logits"])
                        for src, dst in (((0, 0),) if self._in_place else ((0, 1), (1, 0)))]
            for b in bindings if FEATURES in values else ():
                b.bind_ortvalue_output(FEATURES, values[FEATURES])
            self._bound[(spec.batch_size, spec.seq_len)] = Bound(spec, arrays, values, bindings)
        self._parity = 0

    def _load(self, graph_kv_shape: tuple[int, ...]) -> None:
        import onnxruntime as ort

        so, self.shared_pool = session_options(self._threads_option, role_session=True)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        try:
            self.sess = ort.InferenceSession(str(self.path), so,
                                             providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise BundleError(f"{self.path}: onnxruntime cannot load this artifact: {exc}") \
                from None
        # Before binding: an artifact whose inputs are not this role's is a clear error, not
        # onnxruntime's binding failure.
        check_graph_io(self.sess, self.path, self.role, graph_kv_shape, self._num_layers,
                       self.vocab_size)
        self._graph_inputs = {i.name for i in self.sess.get_inputs()}
        # an EAGLE-3 head's target also returns its feature at every position (eagle3.py)
        self.feature_size = next((int(o.shape[-1]) for o in self.sess.get_outputs()
                                  if o.name == FEATURES), 0)

    def _binding(self, inputs: dict[str, Any], kv_in: list[Any], kv_out: list[Any],
                 logits: Any) -> Any:
        """One call's binding: its inputs by name, each layer's KV read from `kv_in` and its
        _RetainedState written to `kv_out` (the same values: in place), and the logits."""
        b = self.sess.io_binding()
        for name, value in inputs.items():
            b.bind_ortvalue_input(name, value)
        for name, value_in, value_out in zip(self._kv_names, kv_in, kv_out):
            b.bind_ortvalue_input(name, value_in)
            b.bind_ortvalue_output(f"{name}_RetainedState", value_out)
        b.bind_ortvalue_output("logits", logits)
        return b

    def _arrays(self, spec: Specialization) -> dict[str, np.ndarray]:
        """The host buffers of one specialization's inputs and logits."""
        arrays: dict[str, np.ndarray] = {
                  "input_ids": np.zeros((spec.batch_size, spec.seq_len), np.int64),
                  "position_ids": np.full((spec.batch_size, spec.seq_len), -1, np.int64),
                  "logits": np.zeros((spec.batch_size, spec.num_logits,
                                      *((self.heads + 1,) if self.heads else ()),
                                      self.vocab_size), np.float32)}
        if "num_logits_to_keep" in self._graph_inputs:
            arrays["num_logits_to_keep"] = np.zeros((spec.num_logits, 1), np.int64)
        if "batch_index" in self._graph_inputs:
            arrays["batch_index"] = np.arange(spec.batch_size, dtype=np.int64).reshape(-1, 1)
        if self.feature_size:
            arrays[FEATURES] = np.zeros((spec.batch_size, spec.seq_len, self.feature_size),
                                        np.float32)
        return arrays

    @property
    def released(self) -> bool:
        return self.sess is None

    def release(self) -> None:
        """Free the loaded weights until `reopen` or the next call (bench makes room for a peer
        that loads its own copy of the models). Only between generations: the KV buffers are
        kept, the compiled graph and its bindings are not."""
        self.sess, self._bound = None, {}

    def reopen(self) -> None:
        if self.sess is None:
            self._open()

    def _entry(self, table: Callable[[], dict[CallShape, Entry]], ids: np.ndarray) -> Entry:
        """What `table` (read after any reload) binds for a call of `ids`' (batch, seq_len):
        a compiled specialization's."""
        shape = (int(ids.shape[0]), int(ids.shape[1]))
        entry = table().get(shape)
        if entry is None and self.sess is None:  # released: load again (bench reopens ahead)
            self._open()
            entry = table().get(shape)
        if entry is None:
            pick_specialization(self.specializations, *shape)  # names what is compiled
            raise BundleError(f"{self.path}: specialization {shape} is compiled but not bound")
        return entry

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray,
            batch_index: np.ndarray | None = None) -> np.ndarray:
        _, arrays, _, bindings = self._entry(lambda: self._bound, input_ids)
        np.copyto(arrays["input_ids"], input_ids)
        np.copyto(arrays["position_ids"], position_ids)
        if batch_index is not None and "batch_index" in arrays:
            np.copyto(arrays["batch_index"], batch_index)
        self.sess.run_with_iobinding(bindings[self._parity])
        self._parity = (self._parity + 1) % len(bindings)
        return self._base(arrays)

    def features(self) -> np.ndarray:
        """[B, S, H] of the last `run`: an EAGLE-3 head's input at each position (FeatureSession)."""
        if self._last_features is None:
            raise BundleError(f"{self.path}: no EAGLE-3 features (this graph returns none, or "
                              "nothing ran yet)")
        return self._last_features

    def _base(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """The base model's logits of a call's output (all of it without heads); the call's
        outputs are kept for `head_logits` and `features`."""
        logits = arrays["logits"]
        self._last_logits, self._last_features = logits, arrays.get(FEATURES)
        return logits[:, :, 0] if self.heads else logits

    def head_logits(self) -> np.ndarray:
        """[B, num_logits, heads, V] of the last `run` (HeadsSession)."""
        if not self.heads or self._last_logits is None:
            raise BundleError(f"{self.path}: no turbo heads' logits (this graph has "
                              f"{self.heads} heads, or nothing ran yet)")
        return self._last_logits[:, :, 1:]


class RowwiseOrtSession(OrtSession):
    """The fused graph, which takes multi-token windows one row per call (ORT's CPU
    GroupQueryAttention), driving a bundle of several rows: continuous batching's KV slots, or
    a static batch.

    Each KV buffer holds every row, [rows, nKV, ctx_len, D]. A call of a window (a verify step,
    a prefill chunk) runs the graph once per row that has a token, bound to that row's slice of
    the KV buffers (a view, written in place) and to its row of the inputs and logits, so
    nothing is copied. A row with no token (a free slot, a finished row) is not run at all, and
    its logits row is left as it was (the loop reads none). A step then costs what its live rows
    cost, where a graph over the whole batch pays for every slot at the full context
    (docs/commands.md, onnxruntime backend: 10.7x faster with one live row of the demo pair's 8
    slots). A single-token call of every row in slot order (a draft step, a step without
    speculation) goes through the graph once for all rows when its batch dim is symbolic: the
    rows then share each weight's read."""

    def __init__(self, path: Path, role: str, specs: list[Specialization], kv_shape: KVShape,
                 num_layers: int, vocab_size: int, threads: int | None = None,
                 min_window: int = 1, heads: int = 0, window_step: int = 1):
        super().__init__(path, role, specs, kv_shape, num_layers, vocab_size, threads,
                         in_place=True, min_window=min_window, heads=heads,
                         window_step=window_step)

    def _open(self) -> None:
        import onnxruntime as ort

        self._load((1, *self._kv_shape[1:]))
        ortvalue = ort.OrtValue.ortvalue_from_numpy
        self._row_kv = [[ortvalue(buf[r:r + 1]) for buf in self.kv_buffers[0]]
                        for r in range(self.batch_size)]
        batch_dim = next(i.shape[0] for i in self.sess.get_inputs() if i.name == "input_ids")
        whole = [ortvalue(buf) for buf in self.kv_buffers[0]] \
            if isinstance(batch_dim, str) else None
        self._in_order = np.arange(self.batch_size)
        # seconds of a single-token call over every row, and per row of one call per row
        self._seconds: dict[str, float | None] = {"together": None, "row": None}
        self._calls = {"together": 0, "row": 0}
        self._single_calls = 0
        self._rows_bound: dict[CallShape, RowsBound] = {}
        for spec in self.specializations:
            arrays = self._arrays(spec)
            together = self._bind(arrays, slice(None), whole) \
                if whole and spec.seq_len == 1 and spec.batch_size == self.batch_size else None
            # row bindings: made when first used
            self._rows_bound[(spec.batch_size, spec.seq_len)] = RowsBound(arrays, {}, together)

    def release(self) -> None:
        super().release()
        self._rows_bound = {}

    def _bind(self, arrays: dict[str, np.ndarray], rows: slice, kv: list[Any]) -> Any:
        """A binding of `rows` of the call's arrays to the KV values `kv`, read and written in
        place."""
        import onnxruntime as ort

        ortvalue = ort.OrtValue.ortvalue_from_numpy
        inputs = {"input_ids": ortvalue(arrays["input_ids"][rows]),
                  "position_ids": ortvalue(arrays["position_ids"][rows])}
        if "num_logits_to_keep" in arrays:
            inputs["num_logits_to_keep"] = ortvalue(arrays["num_logits_to_keep"])
        b = self._binding(inputs, kv, kv, ortvalue(arrays["logits"][rows]))
        if FEATURES in arrays:
            b.bind_ortvalue_output(FEATURES, ortvalue(arrays[FEATURES][rows]))
        return b

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray,
            batch_index: np.ndarray | None = None) -> np.ndarray:
        arrays, made, together = self._entry(lambda: self._rows_bound, input_ids)
        np.copyto(arrays["input_ids"], input_ids)
        np.copyto(arrays["position_ids"], position_ids)
        live = [j for j in range(input_ids.shape[0]) if position_ids[j].max() >= 0]
        if together is not None and live and (batch_index is None or np.array_equal(
                batch_index[:, 0], self._in_order)) and self._together_pays(len(live)):
            t0 = time.perf_counter()
            self.sess.run_with_iobinding(together)  # rows without a token write past the end
            self._timed("together", time.perf_counter() - t0)
            return self._base(arrays)
        t0 = time.perf_counter()
        for j in live:  # rows with no token in this call are not run
            slot = j if batch_index is None else int(batch_index[j, 0])
            if (j, slot) not in made:
                made[(j, slot)] = self._bind(arrays, slice(j, j + 1), self._row_kv[slot])
            self.sess.run_with_iobinding(made[(j, slot)])
        if together is not None and live:
            self._timed("row", (time.perf_counter() - t0) / len(live))
        return self._base(arrays)

    def _together_pays(self, live: int) -> bool:
        """Whether one call over every row (the free ones attend over the whole context) is
        cheaper than `live` calls of one row, by the seconds measured for each; each way is
        tried first (its first call, which sets up the shape, is not counted), and the one not
        taken is timed again every REMEASURE single-token calls."""
        self._single_calls += 1
        row, together = self._seconds["row"], self._seconds["together"]
        if together is None or self._single_calls % REMEASURE == 0:
            return True
        if row is None or self._single_calls % REMEASURE == 1:
            return False
        return together < live * row

    def _timed(self, way: str, seconds: float) -> None:
        self._calls[way] += 1
        if self._calls[way] == 1:
            return  # the first call of a shape pays ORT's set-up
        old = self._seconds[way]
        self._seconds[way] = seconds if old is None else old + 0.2 * (seconds - old)

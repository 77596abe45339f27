"""Proposals from an EAGLE-3 head (export/eagle3.py): a one-layer graph of its own that reads the
target's features and the tokens the target chose.

Every target call returns, beside its logits, the head's input feature at each position it
ran; the row keeps them by position (a rejected draft's feature is rewritten by the next call
that reaches its position, before the head ever reads it). When the row speculates, the head
first catches up: the positions the target verified since its last catch-up, each pairing the
token AFTER it with the target's feature at it (EAGLE's shift: the feature at position p read
the text up to p, and the head predicts the token at p + 2 from it and the token at p + 1).
Its output at the last verified position proposes the first token; each further proposal runs
the head on the token just proposed and the head's own previous output. The head's cache
entries past the verified positions are simply overwritten by the next catch-up.

Greedy rows propose the argmax; sampled rows draw each proposal from the head's softmax under
the row's own sampling settings over the target vocabulary (zero outside the head's draft
vocabulary), which is then the q the acceptance rule divides by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BundleError
from ..export import TARGET_EMBEDDING
from ..ort_threads import session_options
from .policy import ConfidenceStop
from .rows import Eagle3RowState, Row
from .sampling import probabilities, sample

UNREACHABLE = np.float32(-1e30)  # logits of target tokens outside the draft vocabulary
CALL_OUTPUTS = ("logits", "hidden_out", "key", "value")  # what a portable head call reads
IN_PLACE = "past_key_RetainedState"  # an output of the fused graph only


def target_embedding(target_graph: Path, hidden_size: int) -> np.ndarray:
    """The token embedding [V, H] of the target's ONNX Runtime artifact, mapped read-only from
    its external data file: rows are paged in as they are indexed, none is copied."""
    import onnx
    from onnx import TensorProto

    model = onnx.load(str(target_graph), load_external_data=False)
    t = next((t for t in model.graph.initializer if t.name == TARGET_EMBEDDING), None)
    if t is None or t.data_type != TensorProto.FLOAT or len(t.dims) != 2 or \
            t.dims[1] != hidden_size or t.data_location != TensorProto.EXTERNAL:
        raise BundleError(f"{target_graph}: no float32 '{TARGET_EMBEDDING}' [V, {hidden_size}] "
                          "in an external data file, which the EAGLE-3 head reads its tokens from")
    where = {e.key: e.value for e in t.external_data}
    return np.memmap(target_graph.parent / where["location"], np.float32, "r",
                     int(where.get("offset", 0)), tuple(t.dims))


class Eagle3Drafter:
    """The head's ONNX Runtime session and the per-row state it drafts from. Two graph forms:
    the fused one (backends/onnxruntime/eagle3_graph.py) reads and writes each row's cache in
    place through an I/O binding; the portable one (export/eagle3.py) takes the cached
    positions as inputs and returns the call's keys, which are written into the cache here."""

    def __init__(self, path: Path, target_graph: Path, vocab_size: int, ctx_len: int,
                 max_k: int, threads: int | None = None):
        """path: the head's graph; target_graph: the target's artifact, whose token embedding
        the fused form reads."""
        import onnxruntime as ort

        so, _ = session_options(threads, role_session=True)
        try:
            self.sess: Any = ort.InferenceSession(str(path), so,
                                                  providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise BundleError(f"{path}: onnxruntime cannot load the EAGLE-3 head: {exc}") \
                from None
        shapes = {i.name: i.shape for i in self.sess.get_inputs()}
        self.in_place = IN_PLACE in {o.name for o in self.sess.get_outputs()}
        tokens_in = "inputs_embeds" if self.in_place else "input_ids"
        if set(shapes) != {tokens_in, "hidden", "position_ids", "past_key", "past_value"}:
            raise BundleError(f"{path}: not an EAGLE-3 head graph (inputs {sorted(shapes)})")
        self.hidden_size = int(shapes["hidden"][-1])
        self.embedding = target_embedding(target_graph, self.hidden_size) if self.in_place \
            else None
        self.kv_heads, self.head_dim = int(shapes["past_key"][1]), int(shapes["past_key"][3])
        self.vocab_size, self.ctx_len, self.max_k = vocab_size, ctx_len, max_k
        self.ortvalue = ort.OrtValue.ortvalue_from_numpy
        # d2t is a constant output: read by one call on a scratch cache, which also pays the
        # session's first-call set-up before any row is timed
        scratch = np.zeros((1, self.kv_heads, 1, self.head_dim), np.float32)
        self.draft_to_target: np.ndarray = np.asarray(self.sess.run(["draft_to_target"], {
            **self._tokens([0]), "hidden": np.zeros((1, 1, self.hidden_size), np.float32),
            "position_ids": np.zeros((1, 1), np.int64),
            "past_key": scratch, "past_value": scratch})[0], np.int64)
        self.calls = 0  # head calls so far (the engine counts them as draft calls)

    def state(self, row: Row) -> Eagle3RowState:
        if row.eagle3 is None:
            shape = (1, self.kv_heads, self.ctx_len + self.max_k + 1, self.head_dim)
            row.eagle3 = Eagle3RowState(
                np.zeros((self.ctx_len, self.hidden_size), np.float32),
                np.zeros(shape, np.float32), np.zeros(shape, np.float32))
        return row.eagle3

    def keep(self, rows: list[Row], pos: np.ndarray, features: np.ndarray) -> None:
        """The features of one target call ([B, S, H] at positions [B, S], -1 = padding)."""
        for i, r in enumerate(rows[:len(pos)]):
            if r.done:
                continue
            real = pos[i] >= 0
            self.state(r).features[pos[i, real]] = features[i, real]

    def _run(self, st: Eagle3RowState, tokens: list[int], hidden: np.ndarray,
             start: int) -> tuple[np.ndarray, np.ndarray]:
        """The head over `tokens` at positions start.., its cache 0..start-1; writes the call's
        keys at those positions. The last position's logits [Vd] and output [H]."""
        n = len(tokens)
        self.calls += 1
        inputs = {**self._tokens(tokens), "hidden": hidden[None],
                  "position_ids": np.arange(start, start + n, dtype=np.int64)[None]}
        if self.in_place:
            b = self._binding(st)
            for name, value in inputs.items():
                b.bind_cpu_input(name, value)
            for name in ("logits", "hidden_out"):  # each call: their shape is the call's
                b.bind_output(name)
            self.sess.run_with_iobinding(b)
            logits, out = (v.numpy() for v in b.get_outputs()[2:])  # (the cache stays put)
        else:
            logits, out, key, value = self.sess.run(list(CALL_OUTPUTS), {
                **inputs, "past_key": st.keys[:, :, :start], "past_value": st.values[:, :, :start]})
            st.keys[:, :, start:start + n] = key
            st.values[:, :, start:start + n] = value
        return logits[0, -1], out[0, -1]

    def _tokens(self, tokens: list[int]) -> dict[str, np.ndarray]:
        """The call's tokens as the graph takes them: their ids, or (the fused form) their rows
        of the target's embedding."""
        if self.embedding is None:
            return {"input_ids": np.asarray([tokens], np.int64)}
        return {"inputs_embeds": self.embedding[tokens][None]}

    def _binding(self, st: Eagle3RowState) -> Any:
        """The row's I/O binding of the fused graph: its cache read and written in place (bound
        once, before the call's logits and output)."""
        if st.binding is None:
            b = self.sess.io_binding()
            for name, buffer in (("past_key", st.keys), ("past_value", st.values)):
                value = self.ortvalue(buffer)
                b.bind_ortvalue_input(name, value)
                b.bind_ortvalue_output(f"{name}_RetainedState", value)
            st.binding = b
        return st.binding

    def _distribution(self, r: Row, draft_logits: np.ndarray) -> np.ndarray | None:
        """A sampled row's distribution over the target vocabulary (None for a greedy row)."""
        if r.sp.greedy:
            return None
        full = np.full(self.vocab_size, UNREACHABLE, np.float32)
        full[self.draft_to_target] = draft_logits
        return probabilities(full, r.sp)

    def _choose(self, r: Row, draft_logits: np.ndarray, probs: np.ndarray | None) -> int:
        """A proposal, as a target id: the argmax over the draft vocabulary (greedy) or a draw."""
        if probs is None:
            return int(self.draft_to_target[int(draft_logits.argmax())])
        return sample(probs, r.rng)

    def propose(self, rows: list[Row], room: list[int], stop: ConfidenceStop = ConfidenceStop()
                ) -> tuple[list[list[int]], list[list[np.ndarray]] | None]:
        """Up to room[i] proposals per row; a row stops early where the head's distribution for
        the next token is less confident than `stop` asks (it is looked at before the token is
        drawn, as for a draft model, so sampling stays exact)."""
        proposals: list[list[int]] = [[] for _ in rows]
        q: list[list[np.ndarray]] = [[] for _ in rows]
        for i, r in enumerate(rows):
            if r.done or not room[i]:
                continue
            st = self.state(r)
            last = len(r.tokens) - 1  # the features of positions 0..last-1 are the target's
            start = min(st.verified, last - 1)
            logits, out = self._run(st, r.tokens[start + 1:last + 1],
                                    st.features[start:last], start)
            st.verified = last
            for j in range(room[i]):
                if j:
                    logits, out = self._run(st, [proposals[i][-1]], out[None], last - 1 + j)
                probs = self._distribution(r, logits)
                if stop.stops(logits, probs):
                    break
                proposals[i].append(self._choose(r, logits, probs))
                if probs is not None:
                    q[i].append(probs)
        return proposals, q

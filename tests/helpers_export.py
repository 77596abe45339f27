"""Running an exported graph without qpcbuild's runtime, and transformers' logits to compare it
with: shared by the export tests (test_export.py), the vocabulary-subset tests
(test_vocab_subset.py) and the real-model tests (test_real_model.py)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from qpcbuild.export.dialect import onnxruntime_indices


class GraphDriver:
    """Runs an exported graph on ONNX Runtime the way the card does: the KV buffers are fixed-size
    retained state, fed back as the next call's inputs."""

    def __init__(self, onnx_path: Path, batch: int, ctx_len: int, kv_batch: int | None = None):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        # the INT32_MAX invalid indices as ONNX Runtime takes them (export/dialect.py)
        self._indices = {name: ort.OrtValue.ortvalue_from_numpy(v) for name, v in
                         onnxruntime_indices(onnx.load(str(onnx_path),
                                                       load_external_data=False)).items()}
        for name, value in self._indices.items():  # OrtValues must outlive the session
            opts.add_initializer(name, value)
        self.sess = ort.InferenceSession(str(onnx_path), opts,
                                         providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.is_target = "num_logits_to_keep" in self.inputs
        self.kv: dict[str, np.ndarray] = {}
        for i in self.sess.get_inputs():
            if i.name.startswith("past_"):
                _, n_kv, _, head_dim = i.shape
                self.kv[i.name] = np.zeros((kv_batch or batch, n_kv, ctx_len, head_dim),
                                           np.float32)

    def __call__(self, input_ids, position_ids, nlk: int = 1, batch_index=None) -> np.ndarray:
        feeds = {"input_ids": np.asarray(input_ids, np.int64),
                 "position_ids": np.asarray(position_ids, np.int64), **self.kv}
        if batch_index is not None:
            feeds["batch_index"] = np.asarray(batch_index, np.int64).reshape(-1, 1)
        if self.is_target:
            feeds["num_logits_to_keep"] = np.zeros((nlk, 1), np.int64)
        results = dict(zip(self.outputs, self.sess.run(None, feeds)))
        for name in self.kv:
            self.kv[name] = results[f"{name}_RetainedState"]
        return results["logits"]


def prefill(drv: GraphDriver, tokens: list[int], chunk: int) -> np.ndarray:
    """Batch-1 prefill in chunks of `chunk`, the last one padded with position -1."""
    logits = None
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        pad = chunk - len(part)
        ids = np.array([part + [0] * pad])
        pos = np.array([list(range(start, start + len(part))) + [-1] * pad])
        logits = drv(ids, pos, nlk=1)
    return logits


@lru_cache(maxsize=None)
def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path: Path, tokens) -> np.ndarray:
    """transformers' float32 logits for one unpadded row: [S, V]."""
    with torch.no_grad():
        out = hf_model(path)(torch.tensor(np.asarray(tokens)[None], dtype=torch.long))
    return out.logits[0].numpy()


def run_mixed_batch(drv: GraphDriver, tokens: np.ndarray, lengths: list[int], k: int):
    """Two rows of different prompt lengths: a prefill chunk of 8, a second chunk of 8 padded with
    -1 at the end (the shorter row padded more), one decode token, then a K+1 verify window.
    Returns the graph's logits for each step."""
    b = len(lengths)
    steps = {"chunk1": drv(tokens[:, :8], np.tile(np.arange(8), (b, 1)))}
    ids, pos = np.zeros((b, 8), np.int64), np.full((b, 8), -1)
    for r, n in enumerate(lengths):
        ids[r, :n - 8], pos[r, :n - 8] = tokens[r, 8:n], np.arange(8, n)
    steps["chunk2"] = drv(ids, pos)
    steps["decode"] = drv(np.array([[tokens[r, n]] for r, n in enumerate(lengths)]),
                          np.array([[n] for n in lengths]))
    steps["verify"] = drv(np.stack([tokens[r, n + 1:n + 2 + k] for r, n in enumerate(lengths)]),
                          np.stack([np.arange(n + 1, n + 2 + k) for n in lengths]), nlk=k + 1)
    return steps

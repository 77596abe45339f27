"""How the runtime opens a role's ONNX Runtime artifact (the session classes are the runtime's,
runtime/session.py): the loader finds this through the registry."""

from __future__ import annotations

from pathlib import Path

from ...bundle.manifest import Manifest
from ...errors import BundleError
from ...runtime.model_session import Specialization
from ...runtime.session import OrtSession, RowwiseOrtSession
from .manifest import OrtEntry
from .window import reading_problem


def open_session(bundle: Path, manifest: Manifest, role: str,
                 entry: OrtEntry) -> OrtSession | RowwiseOrtSession:
    info, shapes = manifest.roles[role], manifest.shapes
    arch = info.arch
    path = bundle / entry.artifact
    if not path.is_file():
        raise BundleError(f"{bundle}: missing {entry.artifact}")
    if entry.graph == "fused":
        problem = reading_problem(path)  # built where onnxruntime read local_window_size alike?
        if problem:
            raise BundleError(problem)
    threads = info.ort.intra_op_threads if info.ort else None
    specs = [Specialization.from_manifest(s) for s in info.specializations]
    kv_shape = (shapes.kv_batch, arch.num_kv_heads, shapes.ctx_len, arch.head_dim)
    heads = manifest.speculation.turbo_heads if role == "target" else 0
    if entry.graph == "fused" and shapes.kv_batch > 1:  # its windows take one row per call
        return RowwiseOrtSession(path, role, specs, kv_shape, arch.num_layers, arch.vocab_size,
                                 threads, min_window=entry.min_window, heads=heads,
                                 window_step=entry.window_step)
    return OrtSession(path, role, specs, kv_shape, arch.num_layers, arch.vocab_size,
                      threads, in_place=entry.kv_binding == "in_place",
                      min_window=entry.min_window, heads=heads,
                      window_step=entry.window_step)

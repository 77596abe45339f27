"""What the tests and the benchmarks both need, so that neither imports the other: a real OCI
registry (Debian's `docker-registry`, the CNCF distribution server) on a free loopback port with
scratch storage, stopped by its PID; and the smallest manifest the typed model accepts, for the
bench peers' tests. Nothing here imports pytest: tests/registry_server.py adds the skips.

It is in the package (like numpy.testing) because both sides already import the package, which
needs no sys.path entry; nothing else in the package imports it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from .bundle.manifest import Manifest

BINARY = shutil.which("docker-registry") or "/usr/bin/docker-registry"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RegistryServer:
    def __init__(self, root: Path, htpasswd: Path | None = None, auth_config: str = ""):
        self.root = Path(root)
        self.storage = self.root / "storage"
        self.htpasswd = htpasswd
        self.auth_config = auth_config  # an `auth:` section of its own (a token service)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "RegistryServer":
        self.port = self.port or free_port()
        self.storage.mkdir(parents=True, exist_ok=True)
        auth = (f"auth:\n  htpasswd:\n    realm: qpcbuild-test\n    path: {self.htpasswd}\n"
                if self.htpasswd else self.auth_config)
        config = self.root / "config.yml"
        config.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
                          f"    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
                          f"http:\n  addr: {self.address}\n{auth}")
        log = open(self.root / "registry.log", "ab")
        self.proc = subprocess.Popen([BINARY, "serve", str(config)], stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: "
                                   f"{(self.root / 'registry.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=1).status_code in (200, 401):
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("docker-registry did not answer within 20 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def blob_path(self, digest: str) -> Path:
        hexdigest = digest.split(":", 1)[-1]
        return (self.storage / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest /
                "data")

    def blob_bytes(self) -> int:
        """What the registry stores in blobs (each stored once, whoever refers to it)."""
        root = self.storage / "docker/registry/v2/blobs"
        return sum(p.stat().st_size for p in root.rglob("data")) if root.is_dir() else 0


def small_manifest(target: Path, draft: Path | None = None, *, threads: int | None = None,
                   ctx: int = 256, local: bool = True) -> Manifest:
    """A checked Manifest of a bundle whose roles' checkpoints are these folders (as `bench`
    hands them to the peers): the smallest manifest the typed model accepts, for the peer tests
    that need no built bundle. `local`: the folders are known on this machine."""
    from .bundle.manifest import Manifest

    def role(path: Path) -> dict[str, Any]:
        specs = [{"name": f"Decode_{n}", "symbols": {"batch_size": "1", "seq_len": str(n),
                                                      "ctx_len": str(ctx)}} for n in (1, 5)]
        return {"source": {"ref": str(path)}, "specializations": specs,
                "arch": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "vocab_size": 8,
                         "param_count": 0, "eos_token_ids": []},
                "ort": {"core_share": 1.0, "intra_op_threads": threads}, "backends": {}}

    paths = {"target": target, **({"draft": draft} if draft is not None else {})}
    m = Manifest.unsealed({
        "schema": 3, "name": "peer-test", "tokenizer": {"verdict": "identical"},
        "speculation": {"method": "draft_model" if draft is not None else "ngram",
                        "options": {}, "num_speculative_tokens": [0, 4]},
        "shapes": {"batch_size": 1, "prefill_seq_len": 1, "ctx_len": ctx},
        "roles": {r: role(p) for r, p in paths.items()}})
    return m.with_model_paths(paths) if local else m


def write_random_turbo_heads(folder: Path, hidden: int, heads: int = 3, layers: int = 2,
                             seed: int = 0, scale: float = 1.0, tamper=None) -> Path:
    """Random turbo heads in QEfficient's format (models/turbo_heads.py: every repeat of a head
    stored, equal), large enough that their proposals differ from the base model's;
    `tamper(tensors, config)` edits them before they are written (tests of bad folders)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors, config = {}, {"turbo_num_layers": layers, "turbo_num_heads": heads}
    for h in range(heads):
        w = (rng.standard_normal((hidden, hidden)) * scale / np.sqrt(hidden)).astype(np.float32)
        b = (rng.standard_normal(hidden) * 0.3 * scale).astype(np.float32)
        for n in range(layers):
            tensors[f"projections.{h}.{n}.linear.weight"] = w.copy()
            tensors[f"projections.{h}.{n}.linear.bias"] = b.copy()
    if tamper is not None:
        tamper(tensors, config)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "speculator.safetensors"))
    (folder / "speculator_config.json").write_text(json.dumps(config))
    return folder


def write_random_eagle3_head(folder: Path, num_layers: int, hidden: int, vocab: int, *,
                             heads: int = 4, kv_heads: int = 2, intermediate: int = 48,
                             draft_vocab: int | None = None, seed: int = 0, scale: float = 1.0,
                             tamper=None) -> Path:
    """A random EAGLE-3 head in the speculators format (models/eagle3_head.py) for a target of
    `num_layers` layers, hidden size `hidden` and vocabulary `vocab`; the draft vocabulary is
    every other target token unless `draft_vocab` says how many (the first ones).
    `tamper(tensors, config)` edits them before they are written (tests of bad folders)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    vd = draft_vocab or vocab // 2
    head_dim = hidden // heads
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "draft_vocab_size": vd, "norm_before_residual": False,
              "target_hidden_size": hidden,
              "eagle_aux_hidden_state_layer_ids": [min(2, num_layers - 1), num_layers // 2,
                                                   max(num_layers - 3, 0)],
              "transformer_layer_config": {
                  "model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
                  "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                  "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "max_position_embeddings": 256, "vocab_size": vocab, "hidden_act": "silu"}}

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    p = "layers.0"
    tensors = {"fc.weight": mat(hidden, 3 * hidden),
               f"{p}.input_layernorm.weight": norm(), f"{p}.hidden_norm.weight": norm(),
               f"{p}.self_attn.q_proj.weight": mat(heads * head_dim, 2 * hidden),
               f"{p}.self_attn.k_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
               f"{p}.self_attn.v_proj.weight": mat(kv_heads * head_dim, 2 * hidden),
               f"{p}.self_attn.o_proj.weight": mat(hidden, heads * head_dim),
               f"{p}.post_attention_layernorm.weight": norm(),
               f"{p}.mlp.gate_proj.weight": mat(intermediate, hidden),
               f"{p}.mlp.up_proj.weight": mat(intermediate, hidden),
               f"{p}.mlp.down_proj.weight": mat(hidden, intermediate),
               "norm.weight": norm(), "lm_head.weight": mat(vd, hidden) * 4.0}
    target_ids = np.arange(vd, dtype=np.int64) * (2 if draft_vocab is None else 1)
    tensors["d2t"] = target_ids - np.arange(vd, dtype=np.int64)
    if tamper is not None:
        tamper(tensors, config)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_shortcut_eagle3_head(folder: Path, target: Path, keep=lambda token: token % 3 != 1,
                               token_weight: float = 0.0) -> Path:
    """An EAGLE-3 head for the Llama checkpoint in `target` whose distribution overlaps the
    target's own: fc passes the state entering layer L-3 through, the head's layer is that
    layer (its q/k/v read only the hidden half), then the target's final norm and LM head rows.
    So the head is the target with its last layers skipped, predicting roughly the target's
    next token at the position it reads; `keep(token)` picks the draft vocabulary.
    `token_weight` > 0 lets q/k/v read the token's embedding too (that many times the weights
    they apply to the hidden half), so the head's distribution depends on the token it reads."""
    import json

    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((target / "config.json").read_text())
    w = {k: v.astype(np.float32) for k, v in load_file(str(target / "model.safetensors")).items()}
    h, n, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    src = f"model.layers.{n - 3}"
    ids = np.array([t for t in range(vocab) if keep(t)], np.int64)
    lm = w.get("lm_head.weight", w["model.embed_tokens.weight"])

    def tamper(tensors: dict, config: dict) -> None:
        tensors.clear()
        fc = np.zeros((h, 3 * h), np.float32)
        fc[:, 2 * h:] = np.eye(h, dtype=np.float32)
        tensors["fc.weight"] = fc
        for p in ("q", "k", "v"):
            m = w[f"{src}.self_attn.{p}_proj.weight"]
            tensors[f"layers.0.self_attn.{p}_proj.weight"] = np.concatenate(
                [token_weight * m, m], 1)
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "post_attention_layernorm"):
            tensors[f"layers.0.{name}.weight"] = w[f"{src}.{name}.weight"]
        tensors["layers.0.hidden_norm.weight"] = w[f"{src}.input_layernorm.weight"]
        tensors["layers.0.input_layernorm.weight"] = np.ones(h, np.float32)
        tensors["norm.weight"] = w["model.norm.weight"]
        tensors["lm_head.weight"] = np.ascontiguousarray(lm[ids])
        tensors["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
        config["draft_vocab_size"] = len(ids)
        config["eagle_aux_hidden_state_layer_ids"] = [2, n // 2, n - 3]
        config["transformer_layer_config"].update(
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))

    return write_random_eagle3_head(folder, n, h, vocab, tamper=tamper)

"""The peers a user would otherwise pick, on the same checkpoints and prompts, that a pip install
provides: Hugging Face transformers (PyTorch, CPU) and onnxruntime-genai. Each is run only when
installed and never faked: a missing one is reported as skipped, with the reason.
Every peer is a `PeerMaker`: `make(manifest, ks, max_new, eos_ids, cache_dir, say) -> Peer`; its
cases are (Measure, run) pairs that `run_bench` times beside ours. `PEERS` names them by the name
`--peers` takes; the peers that need a build or an environment of their own (llama.cpp, vLLM) live
in a checkout's benchmarks/peers/, which adds them here with `add_peers` before it runs bench."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from ..errors import UsageError
from ..measuring import Say, package_version
from .records import Measure

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest

OG_NGRAM_SIZE = 3  # onnxruntime-genai n-gram length (its range is 2..); ours: prompt_lookup 1..4


@dataclass
class Peer:
    name: str
    status: str  # "ok" | "skipped" | "failed"
    note: str = ""
    version: str | None = None
    cases: list[tuple[Measure, Callable]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    # A peer that loads its own copy of the models in another process: about how much memory
    # it holds at once, and how to stop holding it (memory_turns.py)
    memory_bytes: int = 0
    stop: Callable[[], None] | None = None


class PeerMaker(Protocol):
    """A peer's set-up: its cases for this bundle, or the reason it is skipped."""

    def __call__(self, manifest: Manifest, ks: list[int], max_new: int, eos_ids: set[int],
                 cache_dir: Path | None, say: Say) -> Peer: ...


NO_CHECKPOINT = ("the target's checkpoint folder is not known: a bundle records its models by "
                 "reference only, so bench the recipe (not the bundle) to run this peer; or the "
                 "bundle was built with smoke weights")


def local_source(manifest: Manifest, role: str) -> Path | None:
    """The role's checkpoint folder on this machine, when bench was told it."""
    info = manifest.roles.get(role)
    path = info and info.source.path
    if path and Path(path).is_dir() and (Path(path) / "config.json").is_file():
        return Path(path).resolve()  # peers run in folders of their own (vLLM's worker does)
    return None


def transformers_peer(manifest: Manifest, ks: list[int], max_new: int, eos_ids: set[int],
                      cache_dir: Path | None, say: Say) -> Peer:
    """Hugging Face transformers + PyTorch on CPU: the route a user would otherwise take."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except Exception as exc:  # ImportError, or a broken install
        return Peer("transformers", "skipped", f"not installed ({type(exc).__name__}: {exc}); "
                    "pip install 'qpcbuild[bench]'")
    target_path = local_source(manifest, "target")
    if target_path is None:
        return Peer("transformers", "skipped", NO_CHECKPOINT)
    draft_path = local_source(manifest, "draft")
    peer = Peer("transformers", "ok", version=package_version("transformers"))
    try:
        torch.set_num_threads(os.cpu_count() or 1)
        say(f"transformers: loading {target_path}" + (f" and {draft_path}" if draft_path else ""))
        target = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32).eval()
        draft = AutoModelForCausalLM.from_pretrained(str(draft_path), dtype=torch.float32).eval() \
            if draft_path else None
    except Exception as exc:
        return Peer("transformers", "failed", f"could not load the checkpoints: "
                    f"{type(exc).__name__}: {exc}", peer.version)
    peer.info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                 "dtype": "float32", "device": "cpu"}
    peer.note = (f"PyTorch {torch.__version__} on CPU, {torch.get_num_threads()} threads, float32; "
                 "assisted K: fixed K per step (constant schedule, no confidence threshold)")
    eos = sorted(eos_ids)
    pad = eos[0] if eos else 0
    default_draft_cfg = copy.deepcopy(draft.generation_config) if draft is not None else None

    def runner(assist: str | None, k: int | None) -> Callable:
        def run(prompt_ids, acc):
            outs, tokens, seconds = [], 0, 0.0
            if assist == "draft":
                cfg = copy.deepcopy(default_draft_cfg)
                if k is not None:  # fixed K, every step: the like-for-like setting
                    cfg.num_assistant_tokens = k
                    cfg.num_assistant_tokens_schedule = "constant"
                    cfg.assistant_confidence_threshold = 0.0
                draft.generation_config = cfg
            for ids in prompt_ids:
                x = torch.tensor([ids], dtype=torch.long)
                kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(x),
                                              max_new_tokens=max_new, do_sample=False,
                                              pad_token_id=pad, eos_token_id=eos or None)
                if assist == "draft":
                    kwargs["assistant_model"] = draft
                elif assist == "lookup":
                    kwargs["prompt_lookup_num_tokens"] = k
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = target.generate(x, **kwargs)
                seconds += time.perf_counter() - t0
                new = out[0, len(ids):].tolist()
                outs.append(new)
                tokens += len(new)
            return outs, tokens, seconds
        return run

    peer.cases.append((Measure("transformers", "target_only", None, "target-only"),
                       runner(None, None)))
    if draft is not None:
        peer.cases.append((Measure("transformers", "draft_model", None,
                                   "assisted (transformers defaults)"), runner("draft", None)))
        for k in ks:
            peer.cases.append((Measure("transformers", "draft_model", k, f"assisted K={k}"),
                               runner("draft", k)))
    for k in ks:
        peer.cases.append((Measure("transformers", "ngram", k, f"prompt lookup K={k}"),
                           runner("lookup", k)))
    return peer


def _genai_build(src: Path, out: Path, tmp: Path, say: Say) -> None:
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o",
           str(out), "-p", "fp32", "-e", "cpu", "-c", str(tmp)]
    say("onnxruntime-genai: " + " ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        raise RuntimeError("model builder failed: " + " | ".join(tail))


def genai_models(manifest: Manifest, cache_dir: Path | None, say: Say) -> dict[str, Path]:
    """Build (once, in the qpcbuild cache) onnxruntime-genai models of the bundle's checkpoints:
    'target', and 'speculative' (the target plus the draft as its `model.draft`)."""
    from ..cache import Cache
    from ..plan import digest

    roles = {r: local_source(manifest, r) for r in ("target", "draft")}
    key = digest({"genai": package_version("onnxruntime-genai"), "precision": "fp32",
                  **{r: manifest.roles[r].source.weights_digest
                     for r in roles if roles[r]}, "paths": {r: str(p) for r, p in roles.items()}})

    def build(tmp: Path) -> dict[str, Any]:
        scratch = tmp / ".scratch"
        _genai_build(roles["target"], tmp / "target", scratch, say)
        if roles["draft"] is not None:
            _genai_build(roles["draft"], tmp / "draft", scratch, say)
            spd = tmp / "speculative"
            spd.mkdir()
            for f in (tmp / "target").iterdir():
                os.link(f, spd / f.name)
            (spd / "draft").mkdir()
            for f in (tmp / "draft").glob("model.onnx*"):
                os.link(f, spd / "draft" / f.name)
            cfg = json.loads((tmp / "target" / "genai_config.json").read_text())
            dcfg = json.loads((tmp / "draft" / "genai_config.json").read_text())["model"]["decoder"]
            dcfg["filename"] = "draft/model.onnx"
            cfg["model"]["draft"] = dcfg
            (spd / "genai_config.json").unlink()
            (spd / "genai_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        shutil.rmtree(scratch, ignore_errors=True)
        return {"target": str(roles["target"]), "draft": str(roles["draft"])}

    entry, _, reused = Cache(cache_dir).get_or_build("genai", key, build)
    if reused:
        say(f"onnxruntime-genai: reusing models in {entry}")
    out = {"target": entry / "target"}
    if (entry / "speculative").is_dir():
        out["speculative"] = entry / "speculative"
    return out


def ort_genai_peer(manifest: Manifest, ks: list[int], max_new: int, eos_ids: set[int],
                   cache_dir: Path | None, say: Say) -> Peer:
    """onnxruntime-genai on the same checkpoints: its model builder, then its Generator loop."""
    try:
        import onnxruntime_genai as og
    except Exception as exc:
        return Peer("onnxruntime-genai", "skipped", f"not installed ({type(exc).__name__}: "
                    f"{exc}); pip install onnxruntime-genai")
    version = package_version("onnxruntime-genai")
    if local_source(manifest, "target") is None:
        return Peer("onnxruntime-genai", "skipped", NO_CHECKPOINT, version)
    try:
        dirs = genai_models(manifest, cache_dir, say)
        models = {name: og.Model(str(d)) for name, d in dirs.items()}
    except Exception as exc:
        return Peer("onnxruntime-genai", "failed", f"{type(exc).__name__}: {exc}", version)
    peer = Peer("onnxruntime-genai", "ok", version=version)
    has_spec = hasattr(og.GeneratorParams, "set_speculative_options")
    peer.info = {"models": {k: str(v) for k, v in dirs.items()}, "precision": "fp32",
                 "execution_provider": "cpu", "session_options": "builder defaults",
                 "speculative_api": has_spec, "ngram_size": OG_NGRAM_SIZE}

    def runner(model_name: str, spec: dict[str, Any] | None) -> Callable:
        model = models[model_name]

        def run(prompt_ids, acc):
            outs, tokens, seconds = [], 0, 0.0
            for ids in prompt_ids:
                t0 = time.perf_counter()
                params = og.GeneratorParams(model)
                params.set_search_options(max_length=len(ids) + max_new, do_sample=False)
                if spec:
                    params.set_speculative_options(**spec)
                g = og.Generator(model, params)
                g.append_tokens(ids)
                while not g.is_done():
                    g.generate_next_token()
                seq = [int(t) for t in g.get_sequence(0)]
                seconds += time.perf_counter() - t0
                new = seq[len(ids):]
                outs.append(new)
                tokens += len(new)
                if acc is not None and spec:
                    st = g.get_speculative_stats()
                    for key in ("rounds", "draft_tokens_proposed", "draft_tokens_accepted",
                                "draft_forward_passes", "target_forward_passes"):
                        acc[key] = acc.get(key, 0) + int(st.get(key, 0))
            return outs, tokens, seconds
        return run

    peer.cases.append((Measure("onnxruntime-genai", "target_only", None, "target-only"),
                       runner("target", None)))
    if not has_spec:
        peer.note = f"speculative decoding: not available in onnxruntime-genai {version}"
        return peer
    if "speculative" in models:
        for k in ks:
            if 1 <= k <= 16:
                peer.cases.append((Measure("onnxruntime-genai", "draft_model", k,
                                           f"draft model K={k}"),
                                   runner("speculative", {"max_draft_tokens": k})))
    for k in ks:
        if 1 <= k <= 16:
            peer.cases.append((Measure("onnxruntime-genai", "ngram", k, f"n-gram K={k}"),
                               runner("target", {"ngram_size": OG_NGRAM_SIZE,
                                                 "max_draft_tokens": k})))
    peer.note = (f"speculative decoding available in {version}: draft model (genai_config "
                 f"model.draft) and n-gram (ngram_size={OG_NGRAM_SIZE})")
    return peer


PEERS: dict[str, PeerMaker] = {"transformers": transformers_peer,
                               "onnxruntime-genai": ort_genai_peer}
ALIASES = {"ort-genai": "onnxruntime-genai"}

# The peers a pip install cannot provide: named here only so that asking for one says where it is
MEASURED_FROM_A_CHECKOUT = ("llama.cpp", "llama-lookup", "llama-speculative", "vllm")


def add_peers(makers: Mapping[str, PeerMaker]) -> None:
    """Make more peers available to `--peers` in this process (benchmarks/peers/run.py adds
    llama.cpp's and vLLM's this way)."""
    PEERS.update(makers)


def find_peer(name: str) -> PeerMaker:
    """The peer `--peers` calls `name`; a UsageError naming the choices when there is none."""
    name = ALIASES.get(name, name)
    if name in PEERS:
        return PEERS[name]
    if name in MEASURED_FROM_A_CHECKOUT:
        raise UsageError(f"peer '{name}' needs a build or an environment of its own, so the "
                         "package does not carry it: from a checkout, `make peers` sets it up and "
                         f"`python benchmarks/peers/run.py BUNDLE --peers {name}` measures it "
                         "beside ours (docs/bench.md)")
    raise UsageError(f"unknown peer '{name}' ({' | '.join(PEERS)})")

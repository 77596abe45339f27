"""`qpcbuild bench`: every method and K a bundle supports, target-only, and the peers a user would
otherwise pick, measured side by side in one run on one prompt set.

What one run does
-----------------
* Ours: each method the bundle supports (draft_model when it has a draft; ngram and suffix always,
  they need no model) at each requested K, plus target-only decoding at the smallest compiled K
  (ideally 0). All methods share one set of ONNX Runtime sessions.
* Peers, when installed (never faked; a missing one is reported as skipped with the reason):
  Hugging Face transformers on PyTorch/CPU (target-only, assisted generation with the draft at
  each K and with transformers' own defaults, prompt lookup at each K) and onnxruntime-genai on
  the same checkpoints (target-only, and its speculative decoding: draft model and n-gram).
* Repeats are interleaved (each repeat runs every configuration, ours and the peers', over the
  whole prompt set in turn), so drift of a busy machine hits all of them alike while each runs
  warm as it would in use. A warm-up pass on the first prompt comes first and is not counted.
* Greedy decoding throughout; each configuration's tokens are compared with our target-only
  tokens (ours must match exactly; a peer's match is reported, not required).

tokens/s = new tokens / wall time of the generate calls (prefill included), per repeat; the
table shows the mean and the standard deviation over repeats. speedup = tokens/s / target-only
tokens/s of the same run (the spread is that of the per-repeat ratios).
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import UsageError
from .prompts import read_prompt_file

PROMPT_DIR = Path(__file__).resolve().parent / "data" / "prompts"
PROMPT_SETS = ("code", "echo", "prose")
OUR_METHODS = ("draft_model", "ngram", "suffix")
BENCH_KS = tuple(range(0, 9))  # compiled into a bench bundle built from a recipe
OG_NGRAM_SIZE = 3  # onnxruntime-genai n-gram length (its range is 2..); ours: prompt_lookup 1..4
REPORT_SCHEMA = 1
SLOW_PEER_FRACTION = 0.25  # a peer configuration slower than this x its target-only is skipped
NOISY_SPREAD = 0.10  # target-only tokens/s varying more than this across repeats: a busy machine
Say = Callable[[str], None]


# ---------------------------------------------------------------- inputs
def parse_ks(text: str | None) -> list[int] | None:
    """'1-8' | '1,2,4' | '1-3,6' -> sorted unique ints; None/'' -> None."""
    if text is None or not str(text).strip():
        return None
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise UsageError(f"cannot read Ks '{text}': use a range and/or a list, such as 1-8 "
                             "or 1,2,4") from None
    if any(k < 0 for k in out):
        raise UsageError(f"Ks must be >= 0, got {text}")
    return sorted(out)


def load_prompts(prompt_file: Path | None = None, prompt_set: str | None = None,
                 limit: int | None = None) -> tuple[str, list[str]]:
    """(label, prompts) from a file or one of the shipped sets (default: code)."""
    if prompt_file is not None and prompt_set is not None:
        raise UsageError("give --prompts FILE or --prompt-set NAME, not both")
    if prompt_file is not None:
        label, prompts = str(prompt_file), read_prompt_file(prompt_file)
    else:
        name = prompt_set or "code"
        if name not in PROMPT_SETS:
            raise UsageError(f"unknown prompt set '{name}' ({' | '.join(PROMPT_SETS)})")
        label, prompts = name, read_prompt_file(PROMPT_DIR / f"{name}.jsonl")
    if limit is not None:
        if limit < 1:
            raise UsageError("the number of prompts must be at least 1")
        prompts = prompts[:limit]
    return label, prompts


# ---------------------------------------------------------------- bundles from recipes
def is_bundle(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "manifest.json").is_file()


def build_for_measurement(recipe_path: Path, overrides: list[str], ks: list[int], out: Path,
                          cache_dir: Path | None = None, say: Say | None = None) -> Path:
    """Compile `recipe_path` with the given Ks (and prefill_seq_len >= max K + 1) into `out`.
    Exports come from the build cache, so only what differs from earlier builds is built."""
    from .bundle import build_bundle
    from .cache import Cache
    from .plan import make_plan
    from .recipe import load_recipe

    say = say or (lambda m: None)
    r = load_recipe(recipe_path, list(overrides))
    extra = ["speculation.num_speculative_tokens=[" + ",".join(str(k) for k in ks) + "]"]
    if r.shapes.prefill_seq_len < max(ks) + 1:
        extra.append(f"shapes.prefill_seq_len={max(ks) + 1}")
    if r.backends != ["onnxruntime"]:
        # Measured on ONNX Runtime on this machine; card-only precisions have no meaning there.
        extra += ["backends=[onnxruntime]", "precision.quantization=none",
                  "precision.kv_cache_dtype=float16"]
        say("measuring on ONNX Runtime: backends=[onnxruntime], card-only precisions off")
    r = load_recipe(recipe_path, [*overrides, *extra])
    plan = make_plan(r)
    say(f"building {out} from {recipe_path} with Ks {list(plan.ks)} (exports from the cache)")

    def progress(stage: str, how: str, seconds: float) -> None:
        say(f"  {stage:<26} {how:<7} {seconds:6.1f} s")

    build_bundle(plan, cache=Cache(cache_dir, say=say), out=out, progress=progress)
    return out


def default_bench_dir(recipe_path: Path, overrides: list[str]) -> Path:
    from .recipe import load_recipe

    r = load_recipe(recipe_path, list(overrides))
    out = r.output_dir()
    return out.with_name(f"{out.name}-bench")


# ---------------------------------------------------------------- measurement records
@dataclass
class Measure:
    """One configuration: per-repeat wall time and tokens, plus summed engine statistics."""
    system: str
    method: str
    k: int | None
    label: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    outputs: list[list[list[int]]] = field(default_factory=list)  # per repeat, per prompt
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    skipped: str | None = None

    def tps(self) -> list[float]:
        return [t / s if s > 0 else 0.0 for t, s in zip(self.tokens, self.seconds)]


SUM_KEYS = ("new_tokens", "target_calls", "draft_calls", "target_time_s", "draft_time_s",
            "e2e_s", "host_overhead_s", "ttft_s", "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "requests")


def _add_stats(acc: dict[str, Any], st: dict[str, Any]) -> None:
    for key in SUM_KEYS:
        acc[key] = acc.get(key, 0) + (st.get(key) or 0)
    per_pos = acc.setdefault("per_pos", [])
    for j, v in enumerate(st.get("spec_decode_num_accepted_tokens_per_pos") or []):
        if j >= len(per_pos):
            per_pos.append(0)
        per_pos[j] += v


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(x, nd)


# ---------------------------------------------------------------- our configurations
def _open_generators(bundle: Path, methods: list[str]) -> dict[str, Any]:
    """One Generator per method, all sharing the bundle's ONNX Runtime sessions (one target, one
    draft): a method is only a different proposer in front of the same sessions."""
    from .runtime.engine import SpecDecoder
    from .runtime.loader import load

    base = load(bundle, method=methods[0], verify="fast")
    gens = {methods[0]: base}
    for m in methods[1:]:
        g = copy.copy(base)
        g.method = m
        g.draft = base.draft if m == "draft_model" else None
        g.decoder = SpecDecoder(base.target, g.draft, _new_proposer(base.manifest, m), base.ks,
                                base.manifest["shapes"]["prefill_seq_len"], base.eos_ids, m)
        gens[m] = g
    return gens


def target_only_generator(gen):
    """A Generator over the same sessions with neither draft nor proposer, for target-only runs.
    (The engine feeds accepted tokens to a method's proposer even in target-only mode, which it
    never started; a proposer-free decoder sidesteps that.)"""
    from .runtime.engine import SpecDecoder

    g = copy.copy(gen)
    g.draft = None
    g.decoder = SpecDecoder(gen.target, None, None, gen.ks,
                            gen.manifest["shapes"]["prefill_seq_len"], gen.eos_ids, gen.method)
    return g


def _new_proposer(manifest: dict, method: str):
    from .runtime.proposers import make_proposer

    if method == "draft_model":
        return None
    spd = manifest["speculation"]
    return make_proposer(method, spd["options"] if spd["method"] == method else {})


def _our_runner(gen, method: str, k: int | None, batch: int, max_new: int) -> Callable:
    target_only = method == "target_only"
    prefill = gen.manifest["shapes"]["prefill_seq_len"]

    def run(prompt_ids: list[list[int]], acc: dict[str, Any] | None) -> tuple[list, int, float]:
        outs, tokens, seconds = [], 0, 0.0
        for start in range(0, len(prompt_ids), batch):
            chunk = prompt_ids[start:start + batch]
            t0 = time.perf_counter()
            res = gen.generate(chunk, max_new, temperature=0.0, target_only=target_only,
                               k=None if target_only else k)
            seconds += time.perf_counter() - t0
            for row in res.rows:
                outs.append(row.tokens[len(row.prompt):])
            tokens += res.stats["new_tokens"]
            if acc is not None:
                _add_stats(acc, res.stats)
                acc["prefill_calls"] = acc.get("prefill_calls", 0) + \
                    max(-(-len(p) // prefill) for p in chunk)
        return outs, tokens, seconds
    return run


# ---------------------------------------------------------------- peers
@dataclass
class Peer:
    name: str
    status: str  # "ok" | "skipped" | "failed"
    note: str = ""
    version: str | None = None
    cases: list[tuple[Measure, Callable]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def _local_source(manifest: dict, role: str) -> Path | None:
    info = manifest["roles"].get(role)
    if not info:
        return None
    path = info["source"].get("path")
    if path and Path(path).is_dir() and (Path(path) / "config.json").is_file() \
            and not info["source"].get("smoke_of"):
        return Path(path)
    return None


def _pkg_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def transformers_peer(manifest: dict, ks: list[int], max_new: int, eos_ids: set[int],
                      say: Say) -> Peer:
    """Hugging Face transformers + PyTorch on CPU: the route a user would otherwise take."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except Exception as exc:  # ImportError, or a broken install
        return Peer("transformers", "skipped", f"not installed ({type(exc).__name__}: {exc}); "
                    "pip install 'qpcbuild[bench]'")
    target_path = _local_source(manifest, "target")
    if target_path is None:
        return Peer("transformers", "skipped", "the bundle's target checkpoint is not a local "
                    "folder (or it was built with smoke weights), so there is nothing to load")
    draft_path = _local_source(manifest, "draft")
    peer = Peer("transformers", "ok", version=_pkg_version("transformers"))
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


def genai_models(manifest: dict, cache_dir: Path | None, say: Say) -> dict[str, Path]:
    """Build (once, in the qpcbuild cache) onnxruntime-genai models of the bundle's checkpoints:
    'target', and 'speculative' (the target plus the draft as its `model.draft`)."""
    from .cache import Cache
    from .plan import digest

    roles = {r: _local_source(manifest, r) for r in ("target", "draft")}
    key = digest({"genai": _pkg_version("onnxruntime-genai"), "precision": "fp32",
                  **{r: manifest["roles"][r]["source"].get("weights_digest")
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


def ort_genai_peer(manifest: dict, ks: list[int], max_new: int, cache_dir: Path | None,
                   say: Say) -> Peer:
    """onnxruntime-genai on the same checkpoints: its model builder, then its Generator loop."""
    try:
        import onnxruntime_genai as og
    except Exception as exc:
        return Peer("onnxruntime-genai", "skipped", f"not installed ({type(exc).__name__}: "
                    f"{exc}); pip install onnxruntime-genai")
    version = _pkg_version("onnxruntime-genai")
    if _local_source(manifest, "target") is None:
        return Peer("onnxruntime-genai", "skipped", "the bundle's target checkpoint is not a "
                    "local folder (or it was built with smoke weights)", version)
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


# ---------------------------------------------------------------- the run
def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "onnxruntime": _pkg_version("onnxruntime")}
    try:
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def run_bench(bundle: Path, prompts: list[str], *, prompt_label: str = "", ks: list[int] | None
              = None, methods: list[str] | None = None, max_new_tokens: int = 128,
              repeats: int = 3, peers: tuple[str, ...] = ("transformers", "onnxruntime-genai"),
              peer_ks: list[int] | None = None, cache_dir: Path | None = None,
              say: Say | None = None) -> dict[str, Any]:
    """Measure and return the report (a JSON-able dict)."""
    from .bundle import read_manifest

    say = say or (lambda m: None)
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if repeats < 1:
        raise UsageError("--repeats must be at least 1")
    compiled = sorted(manifest["roles"]["target"]["compiled_ks"])
    supported = [m for m in OUR_METHODS if m != "draft_model" or "draft" in manifest["roles"]]
    methods = list(methods or supported)
    for m in methods:
        if m not in supported:
            raise UsageError(f"method '{m}' is not supported by this bundle (supported: "
                             f"{', '.join(supported)})")
    ks = list(ks) if ks is not None else [k for k in compiled if k > 0]
    missing = [k for k in ks if k not in compiled]
    if missing:
        raise UsageError(f"K {missing} not compiled in {bundle} (compiled: {compiled}); bench a "
                         "recipe instead to build every K, or pick --ks from the compiled ones")
    ks = [k for k in ks if k > 0]
    if not ks:
        raise UsageError("no K >= 1 to measure")
    peer_ks = list(peer_ks) if peer_ks is not None else ks

    machine = machine_info()  # the load average now, before this run adds to it
    gens = _open_generators(bundle, methods)
    gen = next(iter(gens.values()))
    batch = gen.target.batch_size
    ctx_len = manifest["shapes"]["ctx_len"]
    room = ctx_len - max_new_tokens - 1
    if room < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} does not fit ctx_len {ctx_len}")
    prompt_ids, truncated = [], 0
    for p in prompts:
        ids = gen.encode(p)
        if not ids:
            raise UsageError(f"prompt '{p[:30]}' encodes to no tokens")
        if len(ids) > room:  # keep the end of the prompt: the continuation depends on it
            ids, truncated = ids[-room:], truncated + 1
        prompt_ids.append(ids)
    notes = []
    if truncated:
        notes.append(f"{truncated} prompt(s) cut to their last {room} tokens so that prompt + "
                     f"{max_new_tokens} new tokens fit ctx_len {ctx_len}")

    base_k = compiled[0]
    if base_k != 0:
        notes.append(f"target-only runs on the smallest compiled K ({base_k}, a {base_k + 1}-token "
                     "window) because K=0 is not compiled: the baseline is slower than it could be")
    ours: list[tuple[Measure, Callable]] = [
        (Measure("qpcbuild", "target_only", base_k, "target-only"),
         _our_runner(target_only_generator(gen), "target_only", None, batch, max_new_tokens))]
    for m in methods:
        for k in ks:
            ours.append((Measure("qpcbuild", m, k, f"{m} K={k}"),
                         _our_runner(gens[m], m, k, batch, max_new_tokens)))

    peer_objs: list[Peer] = []
    eos_ids = set(gen.eos_ids)
    for name in peers:
        if name == "transformers":
            peer_objs.append(transformers_peer(manifest, peer_ks, max_new_tokens, eos_ids, say))
        elif name in ("onnxruntime-genai", "ort-genai"):
            peer_objs.append(ort_genai_peer(manifest, peer_ks, max_new_tokens, cache_dir, say))
        else:
            raise UsageError(f"unknown peer '{name}' (transformers | onnxruntime-genai)")
        p = peer_objs[-1]
        say(f"peer {p.name}: {p.status}" + (f" ({p.note})" if p.note else ""))

    cases = ours + [c for p in peer_objs for c in p.cases]
    # Repeats interleaved: every repeat runs every configuration over the whole prompt set in
    # turn (so each runs warm, as it would in use), and drift spreads over all configurations.
    # Repeat 0 is a warm-up on the first prompt batch and is not counted.
    warmup = prompt_ids[:batch]
    started = time.perf_counter()
    gc.collect()
    gc.freeze()  # what is loaded now (models, libraries) stays out of the collections below
    warm_tps: dict[str, float] = {}  # each peer's target-only tokens/s in the warm-up
    baseline_run: dict[str, Callable] = {}
    for rep in range(repeats + 1):
        warm = rep == 0
        for meas, run in cases:
            if meas.error or meas.skipped:
                continue
            if meas.system == "qpcbuild" and meas.method in ("ngram", "suffix"):
                # Its own proposer, fresh each repeat: suffix decoding's cross-request cache
                # holds only the earlier prompts of this pass, never this very continuation.
                gens[meas.method].decoder.proposer = _new_proposer(manifest, meas.method)
            # As timeit does: no cyclic garbage collection inside a timed pass (its pauses would
            # land on whichever configuration happens to run); it runs between passes.
            gc.collect()
            gc.disable()
            try:
                outs, tokens, seconds = run(warmup if warm else prompt_ids,
                                            None if warm else meas.stats)
            except Exception as exc:
                if meas.system == "qpcbuild":
                    raise
                meas.error = f"{type(exc).__name__}: {exc}"
                say(f"  {meas.system} {meas.label} failed: {meas.error}")
                continue
            finally:
                gc.enable()
            rate = tokens / seconds if seconds > 0 else 0.0
            say(f"{'warm-up' if warm else f'repeat {rep}/{repeats}'} {meas.system} {meas.label}: "
                f"{rate:,.0f} tokens/s  (elapsed {time.perf_counter() - started:.0f} s)")
            if not warm:
                meas.seconds.append(seconds)
                meas.tokens.append(tokens)
                meas.outputs.append(outs)
                continue
            if meas.system == "qpcbuild":
                continue
            if meas.method == "target_only":
                warm_tps[meas.system] = rate
                baseline_run[meas.system] = run
            elif rate < SLOW_PEER_FRACTION * warm_tps.get(meas.system, 0.0):
                # Far slower than the peer's own target-only, it cannot be the peer's best
                # configuration (which the goals compare) and would dominate the run. A busy
                # machine slows whole stretches of time, so the check is repeated against the
                # peer's target-only measured right before it, on the same prompt: only a
                # configuration that is slow by itself is left out.
                _, tb, sb = baseline_run[meas.system](warmup, None)
                _, t2, s2 = run(warmup, None)
                ref = tb / sb if sb > 0 else 0.0
                rate2 = t2 / s2 if s2 > 0 else 0.0
                if rate2 < SLOW_PEER_FRACTION * ref:
                    meas.skipped = (f"not measured: {rate2:,.1f} tokens/s in its warm-up "
                                    f"against {ref:,.1f} for this peer's target-only just "
                                    f"before (under {SLOW_PEER_FRACTION:.0%}; first warm-up "
                                    f"{rate:,.1f} against {warm_tps[meas.system]:,.1f})")
                    say(f"  {meas.system} {meas.label}: {meas.skipped}")
    gc.unfreeze()
    return _report(bundle, manifest, prompt_label, prompt_ids, prompts, max_new_tokens, repeats,
                   ks, methods, ours, peer_objs, notes, gen, machine)


# ---------------------------------------------------------------- the report
def _row(meas: Measure, base: Measure, ref_outputs: list[list[list[int]]]) -> dict[str, Any]:
    tps = meas.tps()
    mean, std = _mean_std(tps)
    ratios = [t / b for t, b in zip(tps, base.tps()) if b > 0]
    sp_mean = mean / statistics.fmean(base.tps()) if mean and base.tps() else None
    _, sp_std = _mean_std(ratios)
    same = None
    if meas.outputs and ref_outputs:
        same = all(o == ref_outputs[0] for o in meas.outputs)
    row = {"system": meas.system, "method": meas.method, "k": meas.k, "label": meas.label,
           "tokens_per_s": {"mean": _r(mean, 2), "std": _r(std, 2),
                            "per_repeat": [_r(t, 2) for t in tps]},
           "speedup": {"mean": _r(sp_mean, 3), "std": _r(sp_std, 3)},
           "new_tokens_per_repeat": meas.tokens[0] if meas.tokens else None,
           "seconds_per_repeat": [_r(s, 4) for s in meas.seconds],
           "greedy_matches_target_only": same}
    if meas.error:
        row["error"] = meas.error
    if meas.skipped:
        row["skipped"] = meas.skipped
    st = meas.stats
    if meas.system == "qpcbuild" and st:
        drafts = st.get("spec_decode_num_drafts", 0)
        dtoks = st.get("spec_decode_num_draft_tokens", 0)
        acc = st.get("spec_decode_num_accepted_tokens", 0)
        row.update({
            "acceptance_rate": _r(acc / dtoks) if dtoks else None,
            "mean_acceptance_length": _r(1 + acc / drafts) if drafts else None,
            "acceptance_per_position": [_r(a / drafts) for a in st.get("per_pos", [])]
            if drafts else [],
            "num_drafts": drafts, "num_draft_tokens": dtoks, "num_accepted_tokens": acc,
            "target_calls": st.get("target_calls"), "draft_calls": st.get("draft_calls"),
            "target_time_s": _r(st.get("target_time_s")), "draft_time_s": _r(st.get("draft_time_s")),
            "host_overhead_fraction": _r(st["host_overhead_s"] / st["e2e_s"])
            if st.get("e2e_s") else None,
        })
        bst = base.stats
        dec, bdec = _decode(st), _decode(bst)
        if dec and bdec:
            row["decode_tokens_per_s"] = _r(dec["tokens_per_s"], 2)
            row["decode_speedup"] = _r(dec["tokens_per_s"] / bdec["tokens_per_s"], 3)
        if meas.method == "draft_model" and dec and bdec and st.get("draft_calls"):
            # Over decode steps only (prefill is the same for every configuration and not part
            # of the speculation's economics). The draft's per-call time includes its prefill
            # chunks, so the ideal is slightly pessimistic for the draft.
            t_base = bdec["target_s_per_call"]
            t_spd = dec["target_s_per_call"]
            t_draft = st["draft_time_s"] / st["draft_calls"]
            ideal = dec["tokens_per_step"] * t_base / (meas.k * t_draft + t_spd)
            row["ideal_speedup"] = _r(ideal, 3)
            row["measured_over_ideal"] = _r(row["decode_speedup"] / ideal, 3) \
                if row.get("decode_speedup") and ideal else None
            row["cost_per_call_ms"] = {"target_only_target": _r(t_base * 1e3),
                                       "spd_target": _r(t_spd * 1e3), "draft": _r(t_draft * 1e3)}
    elif st:
        row["peer_stats"] = dict(st)
        if st.get("draft_tokens_proposed"):
            row["acceptance_rate"] = _r(st["draft_tokens_accepted"] / st["draft_tokens_proposed"])
    return row


def _decode(st: dict[str, Any]) -> dict[str, float] | None:
    """Decode-phase figures from summed engine statistics: after each request's first token
    (ttft_s is the target prefill and the first token; decode steps are the target calls that
    are not prefill chunks)."""
    steps = st.get("target_calls", 0) - st.get("prefill_calls", 0)
    decode_s = st.get("e2e_s", 0.0) - st.get("ttft_s", 0.0)
    tokens = st.get("new_tokens", 0) - st.get("requests", 0)
    if steps <= 0 or decode_s <= 0 or tokens <= 0:
        return None
    return {"tokens_per_s": tokens / decode_s, "tokens_per_step": tokens / steps,
            "target_s_per_call": (st["target_time_s"] - st["ttft_s"]) / steps}


def _best(rows: list[dict], pred: Callable[[dict], bool]) -> dict | None:
    cands = [r for r in rows if pred(r) and r["tokens_per_s"]["mean"] and not r.get("error")]
    return max(cands, key=lambda r: r["tokens_per_s"]["mean"]) if cands else None


def _report(bundle, manifest, prompt_label, prompt_ids, prompts, max_new, repeats, ks, methods,
            ours, peer_objs, notes, gen, machine) -> dict[str, Any]:
    from . import __version__

    base = ours[0][0]
    ref = base.outputs
    rows = [_row(m, base, ref) for m, _ in ours]
    peers_out = {}
    all_peer_rows = []
    for p in peer_objs:
        prow = [_row(m, base, ref) for m, _ in p.cases]
        all_peer_rows += prow
        peers_out[p.name] = {"status": p.status, "note": p.note, "version": p.version,
                             "info": p.info, "rows": prow}
    ratios = []
    for p in peer_objs:
        for method in ("target_only", "draft_model", "ngram"):
            mine = _best(rows, lambda r, m=method: r["method"] == m)
            theirs = _best(peers_out[p.name]["rows"], lambda r, m=method: r["method"] == m)
            if mine and theirs:
                ratios.append({"peer": p.name, "method": method, "ours": mine["label"],
                               "theirs": theirs["label"],
                               "ours_over_theirs": round(mine["tokens_per_s"]["mean"]
                                                         / theirs["tokens_per_s"]["mean"], 3)})
        mine = _best(rows, lambda r: True)
        theirs = _best(peers_out[p.name]["rows"], lambda r: True)
        if mine and theirs:
            ratios.append({"peer": p.name, "method": "best", "ours": mine["label"],
                           "theirs": theirs["label"],
                           "ours_over_theirs": round(mine["tokens_per_s"]["mean"]
                                                     / theirs["tokens_per_s"]["mean"], 3)})

    try:
        machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    base_tps = base.tps()
    spread = statistics.pstdev(base_tps) / statistics.fmean(base_tps) \
        if len(base_tps) > 1 and statistics.fmean(base_tps) > 0 else 0.0
    noisy = spread > NOISY_SPREAD
    if noisy:
        notes.append(f"target-only tokens/s varied by {spread:.0%} across repeats ("
                     + ", ".join(f"{t:,.0f}" for t in base_tps) + "): the machine was not quiet; "
                     "compare configurations within a repeat (per_repeat) or run again")
    machine["threads"] = {"qpcbuild_target": _threads(gen.target),
                          "qpcbuild_draft": _threads(gen.draft) if gen.draft else None}
    return {
        "schema": REPORT_SCHEMA, "tool": "qpcbuild bench", "qpcbuild_version": __version__,
        "bundle": str(bundle), "bundle_id": manifest["bundle_id"], "name": manifest["name"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "settings": {"prompt_set": prompt_label, "prompts": len(prompt_ids),
                     "prompt_tokens": [len(p) for p in prompt_ids], "max_new_tokens": max_new,
                     "repeats": repeats, "warmup": "one prompt per configuration, not counted",
                     "interleaving": "per repeat: every configuration runs over all prompts "
                                     "in turn",
                     "gc": "cyclic garbage collection off inside timed calls, run between "
                           "them (as timeit does)",
                     "ks": ks, "methods": methods, "greedy": True,
                     "batch_size": manifest["shapes"]["batch_size"],
                     "ctx_len": manifest["shapes"]["ctx_len"],
                     "prefill_seq_len": manifest["shapes"]["prefill_seq_len"],
                     "compiled_ks": manifest["roles"]["target"]["compiled_ks"],
                     "target_only_k": base.k,
                     "tokens_per_s": "new tokens / wall time of the generate calls (prefill "
                                     "included); mean and std over repeats",
                     "speedup": "tokens/s over the same run's qpcbuild target-only tokens/s",
                     "decode_speedup": "decode phase only (after the first token): decode "
                                       "tokens/s over target-only decode tokens/s",
                     "ideal_speedup": "draft_model, decode steps only: (tokens per verify step) "
                                      "x (target-only time per target call) / (K x draft time "
                                      "per draft call + SpD target time per target call); "
                                      "measured_over_ideal = decode_speedup / ideal_speedup"},
        "baseline": rows[0],
        "rows": rows,
        "all_greedy_outputs_match": all(r["greedy_matches_target_only"] for r in rows),
        "noisy": noisy, "target_only_spread": round(spread, 4),
        "peers": peers_out,
        "ratios": ratios,
        "notes": notes + ["each ngram/suffix configuration starts with a fresh proposer in each "
                          "repeat (suffix decoding's cross-request cache holds only the earlier "
                          "prompts of that pass)"],
    }


def _threads(session) -> int | None:
    try:
        return session.sess.get_session_options().intra_op_num_threads
    except Exception:
        return None


# ---------------------------------------------------------------- output
def default_json_path(bundle: Path, manifest_name: str) -> Path:
    bundle = Path(bundle).resolve()
    return bundle.parent / f"bench-{manifest_name}.json"


def write_json(report: dict[str, Any], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _fmt(mean, std, digits=0, suffix="") -> str:
    if mean is None:
        return "-"
    return f"{mean:,.{digits}f}{suffix}" + (f" ±{std:,.{digits}f}" if std else "")


def _short(x: float) -> str:
    """0.93 -> '.93', 1.0 -> '1.00' (per-position columns stay narrow)."""
    text = f"{x:.2f}"
    return text[1:] if text.startswith("0") else text


def show_report(report: dict[str, Any], console=None) -> None:
    from rich.table import Table

    from rich.console import Console

    from .render import console as default_console
    console = console or default_console
    if not console.is_terminal:  # a file or a pipe: rich would wrap at 80 columns
        console = Console(width=170, highlight=False)
    s = report["settings"]
    m = report["machine"]
    title = (f"{report['name']}: {s['prompts']} prompts ({s['prompt_set']}), {s['max_new_tokens']} "
             f"new tokens, greedy, {s['repeats']} repeats  |  {m['cpu']} x{m['cpu_count']}")
    t = Table("method", "K", "tokens/s", "speedup", "decode x", "accept", "mean len",
              "per-position acceptance", "ideal", "meas/ideal", "host", "= target", title=title,
              title_justify="left")
    for r in report["rows"]:
        pp = r.get("acceptance_per_position") or []
        t.add_row(r["method"], str(r["k"]),
                  _fmt(r["tokens_per_s"]["mean"], r["tokens_per_s"]["std"]),
                  _fmt(r["speedup"]["mean"], r["speedup"]["std"], 2, "x"),
                  "-" if r.get("decode_speedup") is None else f"{r['decode_speedup']:.2f}x",
                  "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.2f}",
                  "-" if r.get("mean_acceptance_length") is None
                  else f"{r['mean_acceptance_length']:.2f}",
                  " ".join(_short(x) for x in pp) or "-",
                  "-" if r.get("ideal_speedup") is None else f"{r['ideal_speedup']:.2f}x",
                  "-" if r.get("measured_over_ideal") is None
                  else f"{r['measured_over_ideal']:.0%}",
                  "-" if r.get("host_overhead_fraction") is None
                  else f"{r['host_overhead_fraction']:.0%}",
                  {True: "[green]yes[/]", False: "[red]NO[/]", None: "-"}[
                      r["greedy_matches_target_only"]])
    console.print(t)
    for name, p in report["peers"].items():
        if p["status"] != "ok":
            console.print(f"[yellow]peer {name}: {p['status']}[/] - {p['note']}")
            continue
        pt = Table("configuration", "tokens/s", "vs our target-only", "accept", "= our tokens",
                   title=f"peer: {name} {p['version'] or ''}  {p['note']}", title_justify="left")
        for r in p["rows"]:
            pt.add_row(r["label"], _fmt(r["tokens_per_s"]["mean"], r["tokens_per_s"]["std"]),
                       _fmt(r["speedup"]["mean"], r["speedup"]["std"], 2, "x"),
                       "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.2f}",
                       r.get("error") or r.get("skipped")
                       or {True: "yes", False: "no", None: "-"}[r["greedy_matches_target_only"]])
        console.print(pt)
    if report["ratios"]:
        rt = Table("peer", "method", "ours (best)", "theirs (best)", "ours / theirs",
                   title="tokens/s ratios, best configuration of each", title_justify="left")
        for x in report["ratios"]:
            rt.add_row(x["peer"], x["method"], x["ours"], x["theirs"],
                       f"{x['ours_over_theirs']:.2f}x")
        console.print(rt)
    if not report["all_greedy_outputs_match"]:
        console.print("[red]greedy outputs differ from target-only for some configuration[/]")
    for n in report["notes"]:
        console.print(f"note: {n}")


def plot_report(report: dict[str, Any], path: Path) -> Path:
    """Two panels: speedup vs K per method (error bars: std over repeats; peers in thin dashed
    lines on the same scale: their tokens/s over our target-only), and acceptance vs K."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"draft_model": "#1f77b4", "ngram": "#2ca02c", "suffix": "#d62728"}
    peer_style = {"transformers": ("o", ":"), "onnxruntime-genai": ("s", "--")}
    rows = report["rows"]
    ks = report["settings"]["ks"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6))
    ours_h, peers_h = [], []
    ours_h.append(ax1.axhline(1.0, color="black", lw=1.2, label="qpcbuild target-only (= 1)"))
    for method in report["settings"]["methods"]:
        pts = sorted((r for r in rows if r["method"] == method
                      and r["speedup"]["mean"] is not None), key=lambda r: r["k"])
        if not pts:
            continue
        ours_h.append(ax1.errorbar([r["k"] for r in pts], [r["speedup"]["mean"] for r in pts],
                                   yerr=[r["speedup"]["std"] or 0 for r in pts],
                                   color=colors.get(method), marker="o", capsize=3, lw=2.2,
                                   label=f"qpcbuild {method}"))
    for name, p in report["peers"].items():
        if p["status"] != "ok":
            continue
        marker, ls = peer_style.get(name, ("x", "-."))
        for r in p["rows"]:
            if r["k"] is None and r["speedup"]["mean"] is not None:  # no K: a reference line
                color = "gray" if r["method"] == "target_only" else colors.get(r["method"])
                peers_h.append(ax1.axhline(r["speedup"]["mean"], color=color, ls=ls, lw=1,
                                           alpha=0.8, label=f"{name} {r['label']}"))
        for method in ("draft_model", "ngram"):
            pts = sorted((r for r in p["rows"] if r["method"] == method and r["k"] is not None
                          and r["speedup"]["mean"] is not None), key=lambda r: r["k"])
            if pts:
                peers_h.append(ax1.plot([r["k"] for r in pts], [r["speedup"]["mean"] for r in pts],
                                        color=colors.get(method), marker=marker, ls=ls, lw=1.2,
                                        mfc="none", alpha=0.85,
                                        label=f"{name} {'assisted / draft' if method == 'draft_model' else 'n-gram / lookup'}")[0])
    ax1.set_xlabel("K (speculative tokens per step)")
    ax1.set_ylabel("speedup over qpcbuild target-only (tokens/s ratio)")
    ax1.set_title("Speedup vs K (error bars: std over repeats)")
    ax1.set_xticks(ks)
    ax1.set_ylim(bottom=0)
    ax1.grid(alpha=0.3)
    ax1.legend(handles=ours_h + peers_h, fontsize=8, loc="upper center",
               bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    ax2b = ax2.twinx()
    acc_h = []
    for method in report["settings"]["methods"]:
        pts = sorted((r for r in rows if r["method"] == method
                      and r.get("acceptance_rate") is not None), key=lambda r: r["k"])
        if not pts:
            continue
        acc_h += ax2.plot([r["k"] for r in pts], [r["acceptance_rate"] for r in pts],
                          color=colors.get(method), marker="o", lw=2,
                          label=f"{method}: acceptance rate")
        acc_h += ax2b.plot([r["k"] for r in pts], [r["mean_acceptance_length"] for r in pts],
                           color=colors.get(method), marker="^", ls="--", lw=1.5,
                           label=f"{method}: mean acceptance length")
    ax2.set_xlabel("K (speculative tokens per step)")
    ax2.set_ylabel("acceptance rate (accepted / proposed), solid")
    ax2b.set_ylabel("mean acceptance length (tokens per step), dashed")
    ax2.set_ylim(0, 1.05)
    ax2b.set_ylim(bottom=1)
    ax2.set_xticks(ks)
    ax2.grid(alpha=0.3)
    ax2.set_title("Acceptance vs K")
    ax2.legend(handles=acc_h, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12),
               ncol=2, frameon=False)
    s, m = report["settings"], report["machine"]
    base_tps = report["baseline"]["tokens_per_s"]["mean"]
    load = m.get("loadavg_at_start", ["?"])[0]
    fig.suptitle(f"qpcbuild bench: {report['name']}, {s['prompts']} prompts "
                 f"({Path(str(s['prompt_set'])).name}), {s['max_new_tokens']} new tokens, greedy, "
                 f"repeats={s['repeats']}; qpcbuild target-only {base_tps:,.0f} tokens/s\n"
                 f"{m['cpu']}, {m['cpu_count']} CPUs, onnxruntime {m.get('onnxruntime')}, "
                 f"load average {load} at start", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends sit below the axes
    plt.close(fig)
    return path


def markdown_table(report: dict[str, Any]) -> str:
    """Per method and K: tokens/s, speedup, acceptance, ideal vs measured, host overhead."""
    lines = ["| method | K | tokens/s | speedup | decode speedup | acceptance | mean acc. len | "
             "ideal (decode) | measured/ideal | host overhead | = target-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append("| " + " | ".join([
            r["method"], str(r["k"]), _fmt(r["tokens_per_s"]["mean"], r["tokens_per_s"]["std"]),
            _fmt(r["speedup"]["mean"], r["speedup"]["std"], 2, "x"),
            "-" if r.get("decode_speedup") is None else f"{r['decode_speedup']:.2f}x",
            "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.3f}",
            "-" if r.get("mean_acceptance_length") is None else f"{r['mean_acceptance_length']:.2f}",
            "-" if r.get("ideal_speedup") is None else f"{r['ideal_speedup']:.2f}x",
            "-" if r.get("measured_over_ideal") is None else f"{r['measured_over_ideal']:.0%}",
            "-" if r.get("host_overhead_fraction") is None
            else f"{r['host_overhead_fraction']:.1%}",
            str(r["greedy_matches_target_only"])]) + " |")
    for name, p in report["peers"].items():
        if p["status"] != "ok":
            lines.append(f"\n{name}: {p['status']} ({p['note']})")
            continue
        lines += ["", f"**{name} {p['version']}** ({p['note']})", "",
                  "| configuration | tokens/s | vs our target-only | = our target-only |",
                  "|---|---|---|---|"]
        for r in p["rows"]:
            lines.append(f"| {r['label']} | {_fmt(r['tokens_per_s']['mean'], r['tokens_per_s']['std'])}"
                         f" | {_fmt(r['speedup']['mean'], r['speedup']['std'], 2, 'x')} | "
                         f"{r.get('error') or r.get('skipped') or r['greedy_matches_target_only']} |")
    if report["ratios"]:
        lines += ["", "| peer | method | ours | theirs | ours / theirs |", "|---|---|---|---|---|"]
        lines += [f"| {x['peer']} | {x['method']} | {x['ours']} | {x['theirs']} | "
                  f"{x['ours_over_theirs']:.2f}x |" for x in report["ratios"]]
    return "\n".join(lines)


# ---------------------------------------------------------------- entry point (CLI and scripts)
def bench(target: Path, *, overrides: list[str] = (), prompt_file: Path | None = None,
          prompt_set: str | None = None, num_prompts: int | None = None,
          ks: list[int] | None = None, methods: list[str] | None = None,
          max_new_tokens: int = 128, repeats: int = 3,
          peers: tuple[str, ...] = ("transformers", "onnxruntime-genai"),
          peer_ks: list[int] | None = None, cache_dir: Path | None = None,
          bundle_out: Path | None = None, json_out: Path | None = None,
          plot: Path | None | bool = None, say: Say | None = None) -> tuple[dict[str, Any], Path, Path | None]:
    """Bundle or recipe -> (report, JSON path, PNG path or None)."""
    say = say or (lambda m: None)
    target = Path(target)
    if is_bundle(target):
        if overrides:
            raise UsageError("--set applies to a recipe; this is a built bundle")
        bundle = target
    elif target.is_file():
        want = sorted(set([0] + list(ks or BENCH_KS)))
        out = Path(bundle_out) if bundle_out else default_bench_dir(target, list(overrides))
        bundle = build_for_measurement(target, list(overrides), want, out, cache_dir, say)
    else:
        raise UsageError(f"{target}: neither a bundle folder (with manifest.json) nor a recipe "
                         "file")
    label, prompts = load_prompts(prompt_file, prompt_set, num_prompts)
    report = run_bench(bundle, prompts, prompt_label=label, ks=ks, methods=methods,
                       max_new_tokens=max_new_tokens, repeats=repeats, peers=peers,
                       peer_ks=peer_ks, cache_dir=cache_dir, say=say)
    json_path = write_json(report, json_out or default_json_path(bundle, report["name"]))
    png = None
    if plot is not False:
        try:
            png = plot_report(report, plot if isinstance(plot, Path) else
                              json_path.with_suffix(".png"))
        except ImportError as exc:
            report["notes"].append(f"no plot: matplotlib is not installed ({exc})")
            write_json(report, json_path)
    return report, json_path, png


# ---------------------------------------------------------------- bench --numerics
NUMERICS_SCHEMA = 1
NUMERICS_TUNE_KS = tuple(range(1, 9))  # the Ks `tune` would consider (its default K_max 8)
CARD_FORMATS = ["precision.quantization=mxfp6", "precision.kv_cache_dtype=mxint8"]


def _numerics_overrides(r) -> tuple[list[str], list[str], list[str]]:
    """(common, fp32, emulated) overrides: both bundles for ONNX Runtime's fused graph at batch
    1 with float32 draft weights (the card has no int8-draft option); the emulated one with the
    recipe's card formats, or mxfp6 + mxint8 when the recipe asks for none."""
    common = ["backends=[onnxruntime]", "onnxruntime.graph=fused", "shapes.batch_size=1",
              "shapes.full_batch_size=null", "onnxruntime.draft_weights=float32"]
    fp32 = ["precision.quantization=none", "precision.kv_cache_dtype=float16"]
    p = r.precision
    if p.quantization == "none" and p.kv_cache_dtype == "float16":
        emu = list(CARD_FORMATS)
    else:
        emu = [f"precision.quantization={p.quantization}",
               f"precision.kv_cache_dtype={p.kv_cache_dtype}"]
    return common, fp32, emu


def teacher_forced_logits(gen, prompt: list[int], output: list[int], window: int) -> np.ndarray:
    """The target's logits for each output token given the prompt and the output before it
    ([len(output), vocab]): the prompt in prefill chunks (as the engine sends them), then the
    output in windows of `window` tokens (a compiled verify specialization)."""
    import numpy as np

    t = gen.target
    p = gen.manifest["shapes"]["prefill_seq_len"]
    rows = []
    for c in range(-(-len(prompt) // p)):
        piece = prompt[c * p:(c + 1) * p]
        ids, pos = np.zeros((1, p), np.int64), np.full((1, p), -1, np.int64)
        ids[0, :len(piece)] = piece
        pos[0, :len(piece)] = np.arange(c * p, c * p + len(piece))
        last = t.run(ids, pos)[0, 0].copy()
    rows.append(last)
    feed = output[:-1]
    for j in range(0, len(feed), window):
        piece = feed[j:j + window]
        ids, pos = np.zeros((1, window), np.int64), np.full((1, window), -1, np.int64)
        ids[0, :len(piece)] = piece
        pos[0, :len(piece)] = np.arange(len(prompt) + j, len(prompt) + j + len(piece))
        rows.extend(t.run(ids, pos)[0, :len(piece)].copy())
    return np.stack(rows)


def _numerics_column(gen, label: str, prompt_ids, max_new: int, k: int, method: str,
                     costs, say: Say) -> tuple[dict[str, Any], list[list[int]]]:
    """Greedy target-only outputs, the SpD run at K (acceptance, tau) and the K `tune` would
    pick from this bundle's acceptance (replayed at every K) and the shared costs."""
    from .tune import (choose_k, draft_matches, predict, replay)

    info = gen.manifest["roles"]["target"]["backends"]["onnxruntime"]
    say(f"{label}: target-only greedy outputs, then {method} at K={k}")
    base = target_only_generator(gen)
    outputs = [base.generate([ids], max_new, temperature=0.0, target_only=True).rows[0]
               for ids in prompt_ids]
    outputs = [r.tokens[len(r.prompt):] for r in outputs]
    if method != "draft_model":
        gen.decoder.proposer = _new_proposer(gen.manifest, method)
    acc: dict[str, Any] = {}
    prefill = gen.manifest["shapes"]["prefill_seq_len"]
    for ids in prompt_ids:
        res = gen.generate([ids], max_new, temperature=0.0, k=k)
        _add_stats(acc, res.stats)
        acc["prefill_calls"] = acc.get("prefill_calls", 0) + -(-len(ids) // prefill)
    drafts = acc.get("spec_decode_num_drafts", 0)
    dtoks = acc.get("spec_decode_num_draft_tokens", 0)
    accepted = acc.get("spec_decode_num_accepted_tokens", 0)
    steps = acc.get("target_calls", 0) - acc.get("prefill_calls", 0)
    col = {"label": label, "numerics": info.get("numerics", "exact"),
           "formats": info.get("numerics_formats") or {"weights": "float32", "kv": "float32"},
           "bundle_id": gen.manifest["bundle_id"], "k": k, "method": method,
           "acceptance_rate": _r(accepted / dtoks) if dtoks else None,
           "acceptance_per_position": [_r(a / drafts) for a in acc.get("per_pos", [])]
           if drafts else [],
           "mean_acceptance_length": _r(1 + accepted / drafts) if drafts else None,
           "tau": _r((acc["new_tokens"] - acc["requests"]) / steps) if steps > 0 else None,
           "num_drafts": drafts, "num_draft_tokens": dtoks, "num_accepted_tokens": accepted,
           "new_tokens": acc.get("new_tokens", 0), "target_calls": acc.get("target_calls", 0)}
    if costs is not None:
        t_verify, t_draft, host = costs
        matches = draft_matches(gen, prompt_ids, outputs) if method == "draft_model" else None
        make = (lambda: _new_proposer(gen.manifest, method)) if method != "draft_model" else None
        ks = [x for x in NUMERICS_TUNE_KS if x in t_verify]
        sims = {x: replay(method, x, prompt_ids, outputs, max_new, matches, make) for x in ks}
        rows = predict(method, {x: sims[x]["alpha"] for x in ks}, t_draft, t_verify, host,
                       {x: sims[x]["proposal_fraction"] for x in ks}, ks)
        col["tune_k"] = choose_k(rows)
        col["tune_table"] = [{key: r[key] for key in ("k", "expected_tokens_per_step",
                                                      "tokens_per_s", "predicted_speedup")}
                             for r in rows]
    return col, outputs


def run_numerics(fp32_bundle: Path, emu_bundle: Path, prompts: list[str], *, prompt_label: str,
                 k: int, max_new_tokens: int, tune_k: bool = True, rounds: int = 10,
                 say: Say | None = None) -> dict[str, Any]:
    import numpy as np

    from .runtime.loader import load
    from .tune import host_model, measure_costs

    say = say or (lambda m: None)
    machine = machine_info()
    gens = {}
    for label, b in (("fp32", fp32_bundle), ("emulated", emu_bundle)):
        m = json.loads((Path(b) / "manifest.json").read_text())
        gens[label] = load(b, method=m["speculation"]["method"], verify="fast")
    g0 = gens["fp32"]
    method = g0.method
    ctx_len = g0.manifest["shapes"]["ctx_len"]
    room = ctx_len - max_new_tokens - 1
    if room < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} does not fit ctx_len {ctx_len}")
    prompt_ids = [g0.encode(p)[-room:] for p in prompts]
    if not all(prompt_ids):
        raise UsageError("a prompt encodes to no tokens")
    notes = []
    costs = None
    if tune_k and all(x in g0.ks for x in NUMERICS_TUNE_KS):
        # Costs are those of this CPU and of the fp32 bundle, shared by both columns: only the
        # acceptance differs between them (the card's own costs are not known here).
        say(f"timing: K draft steps and one K+1 verify for K = 1..{max(NUMERICS_TUNE_KS)}, "
            f"{rounds} rounds (fp32 bundle)")
        position = int(statistics.median(len(p) for p in prompt_ids)) + max_new_tokens // 2
        t_verify, t_draft, _ = measure_costs(g0, list(NUMERICS_TUNE_KS), position, rounds)
        costs = (t_verify, t_draft, None)
    elif tune_k:
        notes.append("tune K omitted: the bundles do not compile K = 1..8")
    columns, outs = [], {}
    for label, gen in gens.items():
        gen.generate([prompt_ids[0]], min(16, max_new_tokens), k=k)  # warm-up, not counted
        if costs is not None:
            # host time per step of this loop, from a short run at K=1 and at K=8
            h = {}
            for kk in (1, max(NUMERICS_TUNE_KS)):
                res = gen.generate([prompt_ids[0]], max_new_tokens, temperature=0.0, k=kk)
                st = res.stats
                steps = max(1, st["target_calls"] - -(-len(prompt_ids[0])
                                                      // gen.manifest["shapes"]["prefill_seq_len"]))
                h[kk] = st["host_overhead_s"] / steps
            col_costs = (costs[0], costs[1], host_model(h))
        else:
            col_costs = None
        col, outs[label] = _numerics_column(gen, label, prompt_ids, max_new_tokens, k, method,
                                            col_costs, say)
        columns.append(col)
    # The emulated target against the fp32 one: greedy agreement and logit drift over the
    # fp32 target's own greedy sequence (the same tokens into both).
    firsts = []
    for a, b in zip(outs["fp32"], outs["emulated"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None and len(a) != len(b):
            n = min(len(a), len(b))
        firsts.append(n)
    say("logit drift: both targets teacher-forced over the fp32 greedy outputs")
    window = k + 1 if k + 1 in [kk + 1 for kk in g0.ks] else max(g0.ks) + 1
    per_pos_sum, per_pos_n, mx, total, count, top1, top1_n = [], [], 0.0, 0.0, 0, 0, 0
    for ids, out in zip(prompt_ids, outs["fp32"]):
        if not out:
            continue
        la = teacher_forced_logits(gens["fp32"], ids, out, window)
        lb = teacher_forced_logits(gens["emulated"], ids, out, window)
        d = np.abs(la.astype(np.float64) - lb)
        mx = max(mx, float(d.max()))
        total += float(d.sum())
        count += d.size
        top1 += int((la.argmax(-1) == lb.argmax(-1)).sum())
        top1_n += len(out)
        for j, row in enumerate(d.mean(axis=-1)):
            if j >= len(per_pos_sum):
                per_pos_sum.append(0.0)
                per_pos_n.append(0)
            per_pos_sum[j] += float(row)
            per_pos_n[j] += 1
    columns[1]["greedy_agreement"] = {
        "prompts": len(firsts), "identical": sum(f is None for f in firsts),
        "first_divergence": firsts,
        "mean_agreeing_prefix": _r(statistics.fmean(
            len(a) if f is None else f for a, f in zip(outs["fp32"], firsts)), 2)}
    columns[1]["logit_drift"] = {
        "max": _r(mx, 5), "mean": _r(total / count, 6) if count else None,
        "per_position_mean": [_r(s / n, 6) for s, n in zip(per_pos_sum, per_pos_n)],
        "teacher_forced_top1_agreement": _r(top1 / top1_n) if top1_n else None}
    if costs is None and not tune_k:
        notes.append("tune K not computed (--no-tune-k)")
    if costs is not None:
        notes.append("tune K: acceptance replayed at every K = 1..8 from each bundle's own "
                     "greedy outputs and proposals; call costs measured once on this CPU on the "
                     "fp32 bundle and shared by both columns, so a different K comes from "
                     "acceptance alone (the card's costs differ: run `qpcbuild tune` there)")
    notes.append("logit drift: |emulated - fp32| target logits, both teacher-forced over the "
                 "fp32 target's greedy output (prompt in prefill chunks, then "
                 f"{window}-token windows)")
    try:
        machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    from . import __version__
    return {"schema": NUMERICS_SCHEMA, "tool": "qpcbuild bench --numerics",
            "qpcbuild_version": __version__, "name": g0.manifest["name"],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
            "bundles": {"fp32": str(fp32_bundle), "emulated": str(emu_bundle)},
            "settings": {"prompt_set": prompt_label, "prompts": len(prompt_ids),
                         "prompt_tokens": [len(p) for p in prompt_ids],
                         "max_new_tokens": max_new_tokens, "k": k, "method": method,
                         "greedy": True, "batch_size": 1, "ctx_len": ctx_len,
                         "tau": "new tokens after the first over target verify calls (decode "
                                "steps)"},
            "columns": columns, "notes": notes}


def show_numerics(report: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from .render import console as default_console
    console = console or default_console
    if not console.is_terminal:
        console = Console(width=170, highlight=False)
    s = report["settings"]
    fp, emu = report["columns"]
    t = Table("", fp["label"], emu["label"], title=f"{report['name']}: numerics preview, "
              f"{s['prompts']} prompts ({Path(str(s['prompt_set'])).name}), "
              f"{s['max_new_tokens']} new tokens, {s['method']} K={s['k']}, greedy",
              title_justify="left")
    for col in (fp, emu):
        col["_fmt"] = "exact float32" if col["numerics"] == "exact" else \
            f"emulated: weights {col['formats']['weights']}, KV {col['formats']['kv']}"
    t.add_row("numerics", fp["_fmt"], emu["_fmt"])
    for key, name in (("acceptance_rate", "acceptance rate"),
                      ("mean_acceptance_length", "mean acceptance length"),
                      ("tau", "tau (tokens per target call)")):
        t.add_row(name, str(fp[key]), str(emu[key]))
    t.add_row("per-position acceptance", " ".join(_short(x) for x in fp["acceptance_per_position"]),
              " ".join(_short(x) for x in emu["acceptance_per_position"]))
    if "tune_k" in fp:
        t.add_row("K tune would pick", str(fp["tune_k"]), str(emu["tune_k"]))
    g, d = emu["greedy_agreement"], emu["logit_drift"]
    t.add_row("greedy output = fp32 target", "-",
              f"{g['identical']}/{g['prompts']} prompts; first divergence "
              + ", ".join("-" if f is None else str(f) for f in g["first_divergence"]))
    t.add_row("logit drift vs fp32 (max / mean)", "-", f"{d['max']} / {d['mean']}")
    t.add_row("top-1 agreement, teacher-forced", "-", str(d["teacher_forced_top1_agreement"]))
    for col in (fp, emu):
        col.pop("_fmt")
    console.print(t)
    for n in report["notes"]:
        console.print(f"note: {n}")


def numerics_markdown(report: dict[str, Any]) -> str:
    fp, emu = report["columns"]
    g, d = emu["greedy_agreement"], emu["logit_drift"]
    rows = [("acceptance rate", fp["acceptance_rate"], emu["acceptance_rate"]),
            ("per-position acceptance", " ".join(f"{x:.2f}" for x in fp["acceptance_per_position"]),
             " ".join(f"{x:.2f}" for x in emu["acceptance_per_position"])),
            ("mean acceptance length", fp["mean_acceptance_length"], emu["mean_acceptance_length"]),
            ("tau (tokens per target call)", fp["tau"], emu["tau"])]
    if "tune_k" in fp:
        rows.append(("K tune would pick", fp["tune_k"], emu["tune_k"]))
    rows += [("greedy output = fp32 target", "-", f"{g['identical']}/{g['prompts']} prompts "
              "(first divergence at new token " + ", ".join(
                  "-" if f is None else str(f) for f in g["first_divergence"]) + ")"),
             ("logit drift, max / mean", "-", f"{d['max']} / {d['mean']}"),
             ("top-1 agreement (teacher-forced)", "-", d["teacher_forced_top1_agreement"])]
    lines = ["| | fp32 | mxfp6 + mxint8 (emulated) |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def plot_numerics(report: dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp, emu = report["columns"]
    s = report["settings"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    n = max(len(fp["acceptance_per_position"]), len(emu["acceptance_per_position"]))
    xs = list(range(1, n + 1))
    ax1.bar([x - 0.2 for x in xs[:len(fp["acceptance_per_position"])]],
            fp["acceptance_per_position"], width=0.4, label=f"fp32 (tau {fp['tau']})",
            color="#1f77b4")
    ax1.bar([x + 0.2 for x in xs[:len(emu["acceptance_per_position"])]],
            emu["acceptance_per_position"], width=0.4, color="#d62728",
            label=f"mxfp6 + mxint8 emulated (tau {emu['tau']})")
    ax1.set_xticks(xs)
    ax1.set_ylim(0, 1.05)
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("accepted / drafts")
    ax1.set_title(f"Per-position acceptance, {s['method']} K={s['k']}")
    ax1.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=8)
    drift = emu["logit_drift"]["per_position_mean"]
    ax2.plot(range(len(drift)), drift, color="#d62728", lw=1.5)
    ax2.set_xlabel("output position (teacher-forced on the fp32 greedy output)")
    ax2.set_ylabel("mean |logit emulated - logit fp32|")
    ax2.set_title(f"Logit drift (max {emu['logit_drift']['max']}, mean "
                  f"{emu['logit_drift']['mean']})")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"qpcbuild bench --numerics: {report['name']}, {s['prompts']} prompts, "
                 f"{s['max_new_tokens']} new tokens, greedy", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_numerics(recipe: Path, *, overrides: list[str] = (), prompt_file: Path | None = None,
                   prompt_set: str | None = None, num_prompts: int | None = None,
                   k: int | None = None, max_new_tokens: int = 64, tune_k: bool = True,
                   cache_dir: Path | None = None, bundle_out: Path | None = None,
                   json_out: Path | None = None, plot: Path | None | bool = None,
                   say: Say | None = None) -> tuple[dict[str, Any], Path, Path | None]:
    """Recipe -> two bundles (fp32 and the card's formats emulated) -> report, JSON, PNG."""
    from .recipe import load_recipe

    say = say or (lambda m: None)
    recipe = Path(recipe)
    if is_bundle(recipe) or not recipe.is_file():
        raise UsageError(f"{recipe}: --numerics needs a recipe file (it builds an fp32 and an "
                         "emulated bundle from it)")
    r = load_recipe(recipe, list(overrides))
    if k is None:
        k = max(r.ks)
    if k < 1:
        raise UsageError("--numerics needs a K >= 1")
    common, fp32, emu = _numerics_overrides(r)
    ks = sorted(set([0, k, *NUMERICS_TUNE_KS]))
    out = Path(bundle_out) if bundle_out else default_bench_dir(recipe, list(overrides))
    bundles = {}
    for label, extra in (("fp32", fp32), ("emulated", emu)):
        bundles[label] = build_for_measurement(recipe, [*overrides, *common, *extra], ks,
                                               out / label, cache_dir, say)
    label, prompts = load_prompts(prompt_file, prompt_set, num_prompts)
    report = run_numerics(bundles["fp32"], bundles["emulated"], prompts, prompt_label=label,
                          k=k, max_new_tokens=max_new_tokens, tune_k=tune_k, say=say)
    json_path = write_json(report, json_out or out / f"numerics-{report['name']}.json")
    png = None
    if plot is not False:
        try:
            png = plot_numerics(report, plot if isinstance(plot, Path) else
                                json_path.with_suffix(".png"))
        except ImportError as exc:
            report["notes"].append(f"no plot: matplotlib is not installed ({exc})")
            write_json(report, json_path)
    return report, json_path, png

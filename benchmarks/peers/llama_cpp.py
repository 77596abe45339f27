"""llama.cpp as a bench peer, two ways: through llama-cpp-python (target-only, and prompt lookup
via its `LlamaPromptLookupDecoding`), and llama.cpp's own prompt-lookup program `llama-lookup`
(when $QPCBUILD_LLAMA_CPP_BIN names the folder of a llama.cpp build's programs). Both read a
single .gguf in the target's checkpoint folder, run greedy at batch 1 with our thread count and
are timed as our rows are."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from qpcbuild.bench import NO_CHECKPOINT, Measure, Peer, PeerMaker, Say, local_source
from qpcbuild.toolchain import package_version

if TYPE_CHECKING:
    from qpcbuild.bundle.manifest import Manifest


def _gguf(folder: Path | None, kind: str | None = None) -> Path | None:
    """A checkpoint folder's GGUF file (llama.cpp reads GGUF, not safetensors): with `kind`, the
    one get_peers.py names model-<kind>.gguf; without, the folder's only GGUF, or its float32
    one (model-f32.gguf) where get_peers.py wrote the target at several precisions."""
    if folder is None:
        return None
    if kind is not None:
        named = folder / f"model-{kind}.gguf"
        return named if named.is_file() else None
    found = sorted(folder.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    f32 = folder / "model-f32.gguf"
    return f32 if f32 in found else None


def _no_target_gguf(kind: str | None) -> str:
    if kind is None:
        return NO_GGUF
    return (f"no model-{kind}.gguf in the target's checkpoint folder (python "
            f"benchmarks/peers/get_peers.py gguf --target-types f32,{kind} writes it with "
            "llama.cpp's own llama-quantize from the float32 GGUF)")


def _peer_name(program: str, kind: str | None) -> str:
    """The peer's name: the program, plus the target GGUF's precision when it is not float32."""
    return program if kind is None else f"{program}-{kind}"


def on_quantized_target(maker: Callable[..., Peer], kind: str) -> PeerMaker:
    """`maker` (a llama.cpp program's peer) run on the target's model-<kind>.gguf instead of its
    float32 one: the same weights quantized by llama.cpp itself (its Q4_0, Q4_K_M...)."""
    def make(manifest: Manifest, ks: list[int], max_new: int, eos_ids: set[int],
             cache_dir: Path | None, say: Say) -> Peer:
        return maker(manifest, ks, max_new, eos_ids, cache_dir, say, target_kind=kind)
    return make


NO_GGUF = ("no single .gguf file in the target's checkpoint folder (llama.cpp reads GGUF; for "
           "SmolLM2 `make smollm2-gguf` writes model-f32.gguf, the same float32 weights as "
           "model.safetensors; otherwise llama.cpp's convert_hf_to_gguf.py --outtype f32)")
TIMING_NOTE = ("tokens/s timed as ours: new tokens over the wall time of each prompt's whole "
               "generation, prefill included")


def _backend_threads(manifest: Manifest) -> int:
    """The CPU threads our ONNX Runtime target session runs with for this bundle (same rule)."""
    from qpcbuild.ort_threads import thread_count

    ort = manifest.target.ort
    return thread_count(ort.intra_op_threads if ort else None)


def _lookup_max_ngram(manifest: Manifest) -> int:
    """Our prompt-lookup n-gram length (the bundle's, else the proposer's default, 4)."""
    return int(manifest.speculation.options.get("prompt_lookup_max") or 4)


def _cut_at_eos(tokens: list[int], eos_ids: set[int], max_new: int) -> list[int]:
    """Our engine's stop rule on a token list: an EOS is kept and ends it; at most max_new."""
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos_ids:
            break
    return out


def _omp_note() -> str:
    """llama.cpp's CPU threads are OpenMP's: how they wait (the environment's choice, read when
    the library loads) decides whether it survives a busy machine."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    if policy:
        return f"OMP_WAIT_POLICY={policy}"
    return ("OMP_WAIT_POLICY unset (OpenMP threads spin while waiting: fastest on a quiet "
            "machine; on one busy with other work spinning can make llama.cpp many times "
            "slower, and OMP_WAIT_POLICY=passive avoids that at a cost)")


class _CountingDraft:
    """llama-cpp-python's draft model, counting its calls (one per verification round) and the
    tokens it proposes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls, self.proposed = inner, 0, 0

    def __call__(self, input_ids, /, **kwargs):
        out = self.inner(input_ids, **kwargs)
        self.calls += 1
        self.proposed += len(out)
        return out


# Over 80 lines: the library's availability checks, then the runner closures over one loaded
# model (target-only and prompt lookup), each named.
def llama_cpp_peer(manifest: Manifest, ks: list[int], max_new: int, eos_ids: set[int],
                   cache_dir: Path | None, say: Say) -> Peer:
    """llama.cpp through llama-cpp-python: target-only decoding and, where the library has its
    `LlamaPromptLookupDecoding` draft class, prompt-lookup decoding at each K. Our prompt token
    ids are fed as they are (no re-tokenization); greedy; batch 1; our thread count. (llama.cpp's
    own prompt lookup is the `llama-lookup` program: the "llama-lookup" peer.)"""
    try:
        import llama_cpp
    except Exception as exc:
        return Peer("llama.cpp", "skipped", f"not installed ({type(exc).__name__}: {exc}); "
                    "pip install llama-cpp-python")
    version = package_version("llama-cpp-python") or getattr(llama_cpp, "__version__", None)
    target = local_source(manifest, "target")
    gguf = _gguf(target)
    if gguf is None:
        return Peer("llama.cpp", "skipped", NO_GGUF if target else NO_CHECKPOINT, version)
    lookup = getattr(llama_cpp, "LlamaPromptLookupDecoding", None)
    if lookup is None:
        try:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding as lookup
        except Exception:
            lookup = None
    threads = _backend_threads(manifest)
    ngram = _lookup_max_ngram(manifest)
    ctx = manifest.shapes.ctx_len
    peer = Peer("llama.cpp", "ok", version=version,
                info={"gguf": str(gguf), "n_threads": threads, "n_threads_batch": threads,
                      "n_ctx": ctx, "sampling": "greedy (temp 0)", "input": "our token ids",
                      "prompt_lookup_class": lookup is not None,
                      "prompt_lookup_max_ngram_size": ngram if lookup else None,
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")})
    peer.note = (f"llama-cpp-python {version}, {gguf.name}, {threads} threads (as ours), our "
                 "token ids, greedy; prompt lookup "
                 + (f"via LlamaPromptLookupDecoding (max_ngram_size {ngram}, as ours; "
                    "num_pred_tokens K)" if lookup else "not in this version")
                 + f"; {TIMING_NOTE}; {_omp_note()}")
    models: dict[bool, Any] = {}

    def model(spec: bool):
        if spec not in models:
            # Prompt lookup needs every position's logits (logits_all); target-only does not.
            models[spec] = llama_cpp.Llama(
                model_path=str(gguf), n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                draft_model=_CountingDraft(lookup(max_ngram_size=ngram, num_pred_tokens=1))
                if spec else None, logits_all=spec, verbose=False)
        return models[spec]

    def runner(k: int | None) -> Callable:
        def run(prompt_ids, acc):
            llm = model(k is not None)
            draft = None
            if k is not None:
                draft = _CountingDraft(lookup(max_ngram_size=ngram, num_pred_tokens=k))
                llm.draft_model = draft
            outs, tokens, seconds = [], 0, 0.0
            for ids in prompt_ids:
                llm.reset()
                calls0 = draft.calls if draft else 0
                new: list[int] = []
                t0 = time.perf_counter()
                gen = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                   repeat_penalty=1.0, reset=True)
                for tok in gen:
                    new.append(int(tok))  # an EOS is kept, as our engine keeps it
                    if tok in eos_ids or len(new) >= max_new:
                        break
                gen.close()
                seconds += time.perf_counter() - t0
                outs.append(new)
                tokens += len(new)
                if acc is not None and draft is not None:
                    # Each round is one draft call then one target call; a round yields its
                    # accepted drafts plus one token of the target's; the first token comes
                    # from the prefill.
                    rounds = draft.calls - calls0
                    acc["rounds"] = acc.get("rounds", 0) + rounds
                    acc["draft_tokens_accepted"] = acc.get("draft_tokens_accepted", 0) + \
                        max(0, len(new) - 1 - rounds)
            if acc is not None and draft is not None:
                acc["draft_tokens_proposed"] = acc.get("draft_tokens_proposed", 0) + \
                    draft.proposed
            return outs, tokens, seconds
        return run

    peer.cases.append((Measure("llama.cpp", "target_only", None, "target-only"), runner(None)))
    if lookup is not None:
        for k in ks:
            if k >= 1:
                peer.cases.append((Measure("llama.cpp", "ngram", k, f"prompt lookup K={k}"),
                                   runner(k)))
    return peer


# ---------------------------------------------------------------- llama-lookup (llama.cpp CLI)
LLAMA_CPP_BIN_ENV = "QPCBUILD_LLAMA_CPP_BIN"
LOOKUP_NGRAM = (1, 4)  # llama-lookup's n-gram sizes (LLAMA_NGRAM_MIN/MAX); ours: 1..4
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_STAT = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)
# Debug lines (-lv 5): every sampled token, drafted-and-accepted or not, with its id.
# llama-speculative adds "of sequence N" to its match lines.
_SAMPLED = re.compile(r"the sampled target token (?:matches the \d+th drafted token "
                      r"(?:of sequence \d+ )?)?\((-?\d+), '")


def parse_lookup_output(text: str) -> dict[str, Any]:
    """The figures `llama-lookup` (and `llama-speculative`) prints at its end (stdout and stderr
    together): prompt tokens and prefill seconds ("encoded"), generated tokens and decode-loop
    seconds ("decoded"), n_draft, n_predict, n_drafted, n_accept, and, with debug logging, the id
    of every sampled token in order. Raises ValueError when the timing lines are missing."""
    enc, dec = _ENCODED.findall(text), _DECODED.findall(text)
    if not enc or not dec:
        raise ValueError("no 'encoded ... tokens in ... seconds' / 'decoded ...' lines in the "
                         "output of llama-lookup / llama-speculative")
    out: dict[str, Any] = {"n_input": int(enc[-1][0]), "encode_s": float(enc[-1][1]),
                           "n_decoded": int(dec[-1][0]), "decode_s": float(dec[-1][1])}
    for key, value in _STAT.findall(text):
        out[key] = int(value)
    out["tokens"] = [int(t) for t in _SAMPLED.findall(text)]
    return out


def _llama_cpp_version(exe: Path) -> str | None:
    try:
        proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"version:\s*(\S+)(?:.*?commit (\w+))?", proc.stdout + proc.stderr)
    return (m.group(1) + (f" (commit {m.group(2)})" if m.group(2) else "")) if m else None


def _llama_program(name: str) -> tuple[Path | None, str | None]:
    """(path of llama.cpp's program `name` in $QPCBUILD_LLAMA_CPP_BIN, None) or (None, why)."""
    folder = os.environ.get(LLAMA_CPP_BIN_ENV)
    if not folder:
        return None, (f"set {LLAMA_CPP_BIN_ENV} to the folder holding llama.cpp's {name} "
                      f"program (cmake -B build llama.cpp && cmake --build build --target "
                      f"{name}: build/bin)")
    exe = Path(folder).expanduser() / name
    if not exe.is_file() or not os.access(exe, os.X_OK):
        return None, f"{exe}: no such program (from {LLAMA_CPP_BIN_ENV})"
    return exe, None


class _PromptFiles:
    """Our prompt token ids as text files for llama.cpp's -f (decoded with the target's
    tokenizer; the program's own prompt token count is checked against ours)."""

    def __init__(self, owner: Peer, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.dir = Path(tempfile.mkdtemp(prefix="qpcbuild-llama-cpp-"))
        weakref.finalize(owner, shutil.rmtree, self.dir, True)
        self.paths: dict[tuple[int, ...], Path] = {}

    def __call__(self, ids: list[int]) -> Path:
        key = tuple(ids)
        if key not in self.paths:
            path = self.dir / f"prompt-{len(self.paths)}.txt"
            # llama.cpp's -f drops one final newline of the file: add one, so it reads the text.
            path.write_text(self.tok.decode(list(ids), skip_special_tokens=False) + "\n",
                            encoding="utf-8")
            self.paths[key] = path
        return self.paths[key]


def _cli_runner(command: Callable[[Path], list[str]], prompt_file: _PromptFiles,
                eos_ids: set[int], max_new: int, drafts: bool) -> Callable:
    """A bench runner that starts `command(prompt file)` once per prompt and reads its figures
    (parse_lookup_output): tokens/s from its own prefill + decode-loop seconds."""
    def run(prompt_ids, acc):
        outs, tokens, seconds = [], 0, 0.0
        for ids in prompt_ids:
            cmd = command(prompt_file(ids))
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                                  timeout=900)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-4:]
                raise RuntimeError(f"{Path(cmd[0]).name} exit {proc.returncode}: "
                                   + " | ".join(tail))
            res = parse_lookup_output(proc.stdout + proc.stderr)
            outs.append(_cut_at_eos(res["tokens"], eos_ids, max_new))
            tokens += res["n_decoded"]
            seconds += res["encode_s"] + res["decode_s"]
            if acc is not None:
                acc["prompt_token_mismatch"] = acc.get("prompt_token_mismatch", 0) + \
                    int(res["n_input"] != len(ids))
                if drafts:
                    acc["draft_tokens_proposed"] = acc.get("draft_tokens_proposed", 0) + \
                        res.get("n_drafted", 0)
                    acc["draft_tokens_accepted"] = acc.get("draft_tokens_accepted", 0) + \
                        res.get("n_accept", 0)
        return outs, tokens, seconds
    return run


def _greedy_args(gguf: Path, max_new: int, threads: int, ctx: int, k: int) -> list[str]:
    return ["-m", str(gguf), "--no-escape",
            "-n", str(max(max_new - 1, 1)),  # it stops once it has more than -n
            "--spec-draft-n-max", str(k), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx), "--temp", "0", "--top-k", "1", "--seed", "0",
            "-lv", "5"]  # its debug lines carry every sampled token's id


def _target_tokenizer(target: Path) -> tuple[Any, str | None]:
    try:
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(target / "tokenizer.json")), None
    except Exception as exc:
        return None, ("cannot decode the prompts to text for it: "
                      f"{type(exc).__name__}: {exc}")


CLI_TIMING_NOTE = ("prompt given as text (our ids decoded; its prompt token count is checked); "
                   "tokens/s from its own timing lines: generated tokens over prefill + "
                   "decode-loop seconds (process start and model load excluded); it may run a "
                   "few tokens past max-new-tokens (it checks the limit once per round): those "
                   "count in tokens/s, the compared output is cut at max-new-tokens")


def llama_lookup_peer(manifest: Manifest, ks: list[int], max_new: int, eos_ids: set[int],
                      cache_dir: Path | None, say: Say, target_kind: str | None = None) -> Peer:
    """llama.cpp's own prompt lookup: the `llama-lookup` program, run once per prompt from the
    folder named by $QPCBUILD_LLAMA_CPP_BIN (a llama.cpp build's bin/). Target-only is the same
    program with no drafts (--spec-draft-n-max 0). Its own timing lines are used (prefill +
    decode loop: model loading and process start are not counted); it reads the prompt as text,
    so our token ids are decoded with the bundle's tokenizer and its prompt token count is
    checked. target_kind: run the target's model-<kind>.gguf (on_quantized_target)."""
    name = _peer_name("llama-lookup", target_kind)
    exe, why = _llama_program("llama-lookup")
    if exe is None:
        return Peer(name, "skipped", why)
    target = local_source(manifest, "target")
    gguf = _gguf(target, target_kind)
    if gguf is None:
        return Peer(name, "skipped", _no_target_gguf(target_kind) if target else NO_CHECKPOINT)
    tok, why = _target_tokenizer(target)
    if tok is None:
        return Peer(name, "skipped", why)
    version = _llama_cpp_version(exe)
    threads = _backend_threads(manifest)
    ctx = manifest.shapes.ctx_len
    peer = Peer(name, "ok", version=version,
                info={"program": str(exe), "gguf": str(gguf), "threads": threads, "n_ctx": ctx,
                      "ngram_sizes": list(LOOKUP_NGRAM), "sampling": "greedy (--temp 0 "
                      "--top-k 1)", "input": "prompt text decoded from our token ids",
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")})
    peer.note = (f"{exe.name} {version or ''}, {gguf.name}, {threads} threads (as ours), greedy, "
                 f"n-grams {LOOKUP_NGRAM[0]}..{LOOKUP_NGRAM[1]} over the context, "
                 f"target-only = --spec-draft-n-max 0; {CLI_TIMING_NOTE}; {_omp_note()}")
    files = _PromptFiles(peer, tok)

    def runner(k: int) -> Callable:
        return _cli_runner(lambda f: [str(exe), "-f", str(f), *_greedy_args(
            gguf, max_new, threads, ctx, k)], files, eos_ids, max_new, drafts=k > 0)

    peer.cases.append((Measure(name, "target_only", None, "target-only (no drafts)"),
                       runner(0)))
    for k in ks:
        if k >= 1:
            peer.cases.append((Measure(name, "ngram", k, f"llama-lookup K={k}"), runner(k)))
    return peer


def llama_speculative_peer(manifest: Manifest, ks: list[int], max_new: int, eos_ids: set[int],
                           cache_dir: Path | None, say: Say,
                           target_kind: str | None = None) -> Peer:
    """llama.cpp's own draft-model speculative decoding: the `llama-speculative` program from
    $QPCBUILD_LLAMA_CPP_BIN, on the one .gguf in the target's folder and the one in the draft's
    (e.g. llama.cpp's convert_hf_to_gguf.py: --outtype f32 for the target, the draft at the
    precision ours reads), greedy, at each K; --spec-draft-p-min 0 so that it drafts K tokens
    as ours does. Its target-only row is the "llama-lookup" peer's (the same llama.cpp build
    and target file, no drafts). target_kind: run the target's model-<kind>.gguf
    (on_quantized_target)."""
    name = _peer_name("llama-speculative", target_kind)
    exe, why = _llama_program("llama-speculative")
    if exe is None:
        return Peer(name, "skipped", why)
    target, draft = local_source(manifest, "target"), local_source(manifest, "draft")
    if draft is None:
        return Peer(name, "skipped", "the bundle has no draft model (or its checkpoint folder "
                    "is not known: bench the recipe)")
    t_gguf, d_gguf = _gguf(target, target_kind), _gguf(draft)
    if t_gguf is None:
        return Peer(name, "skipped", _no_target_gguf(target_kind))
    if d_gguf is None:
        return Peer(name, "skipped", "no single .gguf file in the draft's checkpoint folder "
                    "(llama.cpp reads GGUF: convert_hf_to_gguf.py writes one)")
    tok, why = _target_tokenizer(target)
    if tok is None:
        return Peer(name, "skipped", why)
    version = _llama_cpp_version(exe)
    threads = _backend_threads(manifest)
    ctx = manifest.shapes.ctx_len
    peer = Peer(name, "ok", version=version,
                info={"program": str(exe), "target_gguf": str(t_gguf), "draft_gguf": str(d_gguf),
                      "threads": threads, "n_ctx": ctx, "sampling": "greedy (--temp 0 --top-k 1)",
                      "input": "prompt text decoded from our token ids",
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")})
    peer.note = (f"{exe.name} {version or ''}, target {t_gguf.name}, draft {d_gguf.name}, "
                 f"{threads} threads for each (as ours), greedy, --spec-draft-p-min 0; "
                 f"{CLI_TIMING_NOTE}; {_omp_note()}")
    files = _PromptFiles(peer, tok)

    def runner(k: int) -> Callable:
        return _cli_runner(lambda f: [str(exe), "-f", str(f), "-md", str(d_gguf), "-td",
                                      str(threads), "--spec-draft-p-min", "0",
                                      *_greedy_args(t_gguf, max_new, threads, ctx, k)],
                           files, eos_ids, max_new, drafts=True)

    for k in ks:
        if k >= 1:
            peer.cases.append((Measure(name, "draft_model", k, f"llama-speculative K={k}"),
                               runner(k)))
    return peer

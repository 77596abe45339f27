"""Bundle -> ready generator: verify the manifest, open one session per role, pick the proposer.

    import qpcbuild
    gen = qpcbuild.load("build/demo")
    out = gen.generate(["def fibonacci(n):"], max_new_tokens=64)
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..bundle import verify_bundle
from ..bundle.manifest import Manifest, SealedManifest
from ..bundle.signature import check_signature
from ..backend_api import DEFAULT_BACKEND, BackendEntry, backend_module, backend_names
from ..errors import BundleError, UsageError
from ..recipe.schema import METHODS
from .chat import ChatTemplate, as_messages
from .engine import SpecDecoder
from ..export import EAGLE3_DIR, GRAPH_FILE
from .eagle3 import Eagle3Drafter
from .model_session import FeatureSession, HeadsSession, ModelSession
from .policy import POLICIES
from .proposers import Proposer, make_proposer
from .rows import Row, TokenCallback
from .sampling import SamplingParams
from .stats import SpecDecodingStats

if TYPE_CHECKING:  # (the worker's module is imported where a bundle needs it)
    from .disagg import PrefillWorker

@dataclass
class GenerationResult:
    texts: list[str]
    rows: list[Row]
    stats: SpecDecodingStats
    handoff: dict[str, Any] | None = None  # a disaggregated bundle's KV hand-offs

    def to_dict(self) -> dict[str, Any]:
        return {"outputs": [{"text": t, "token_ids": r.tokens[len(r.prompt):],
                             "prompt_tokens": len(r.prompt), "finish_reason": r.finish_reason}
                            for t, r in zip(self.texts, self.rows)],
                "stats": self.stats.to_json(),
                **({"handoff": self.handoff} if self.handoff is not None else {})}


RoleName = Literal["target", "draft"]  # the manifest's roles


def _backend_entry(bundle: Path, manifest: Manifest, role: RoleName,
                   backend: str) -> BackendEntry:
    if backend not in backend_names():
        raise UsageError(f"unknown backend '{backend}' ({' | '.join(backend_names())})")
    built = manifest.roles[role].backends
    if backend not in built:
        raise BundleError(f"{bundle}: the {role} was not built for backend '{backend}' (built: "
                          f"{', '.join(built)})")
    return built[backend]


def _open_session(bundle: Path, manifest: Manifest, role: RoleName,
                  backend: str) -> ModelSession:
    entry = _backend_entry(bundle, manifest, role, backend)
    # each backend's session module (backends/<name>/session.py), found by name
    session: ModelSession = backend_module(backend, "session").open_session(
        bundle, manifest, role, entry)
    return session


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(bundle: Path, manifest: Manifest, roles: list[RoleName],
                 backend: str) -> None:
    """Refuse before allocating when weights and KV cache cannot fit in this machine's memory
    (the ONNX Runtime artifacts hold float32 weights and a float32 KV cache; a card's memory is
    the compiler's business)."""
    shapes = manifest.shapes
    batch = shapes.kv_batch
    need = 0.0
    for role in roles:
        info = manifest.roles[role]
        arch, entry = info.arch, info.backends.get(backend)
        if entry is None:
            continue  # _open_session says it is not built
        kv = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4.0  # float32, per token
        need += entry.host_bytes(arch.param_count, kv, shapes.ctx_len * batch)
    free = available_memory()
    if free is not None and need > free:
        raise BundleError(f"{bundle}: running it needs about {need / 2**30:.1f} GiB (float32 "
                          f"weights and KV cache for ctx_len {shapes.ctx_len} x batch "
                          f"{batch}), but only {free / 2**30:.1f} GiB is available here")


class Generator:
    def __init__(self, bundle: Path, manifest: Manifest, backend: str, method: str,
                 k: int | None, policy: str | None = None):
        from tokenizers import Tokenizer

        self.bundle, self.manifest, self.backend, self.method = bundle, manifest, backend, method
        self.ks = manifest.ks
        if k is not None and k not in self.ks:
            raise UsageError(f"--k {k} is not compiled in this bundle (compiled Ks: "
                             f"{list(self.ks)}); rebuild with speculation.num_speculative_tokens")
        self.k = k
        if method == "eagle3" and backend != DEFAULT_BACKEND:  # before any session opens
            raise UsageError(f"eagle3 runs its head on {DEFAULT_BACKEND} only in this version: "
                             f"the {backend} runtime does not open the head (a card bundle "
                             "carries the head's compiler inputs beside the target's, for "
                             f"qaic-compile); use --backend {DEFAULT_BACKEND}, or --method ngram "
                             "or suffix on this backend")
        tok_file = bundle / "tokenizer" / "tokenizer.json"
        if not tok_file.is_file():
            raise BundleError(f"{bundle}: no tokenizer/tokenizer.json; this bundle can only be "
                              "driven with token ids")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises its own exception types
            raise BundleError(f"{tok_file}: not a usable tokenizer "
                              f"({str(exc).splitlines()[0][:200] if str(exc) else exc!r})") \
                from None
        self._chat: ChatTemplate | None = None
        self.eos_ids = set(manifest.target.arch.eos_token_ids)
        gen_cfg = bundle / "tokenizer" / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            self.eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        roles: list[RoleName] = ["target", "draft"] if method == "draft_model" else ["target"]
        check_memory(bundle, manifest, roles, backend)
        self.target = _open_session(bundle, manifest, "target", backend)
        self.draft = _open_session(bundle, manifest, "draft", backend) \
            if method == "draft_model" else None
        self.policy = policy  # None: the bundle's speculation.policy
        self.prefill_worker = None
        if manifest.disaggregated is not None:  # prefill runs in a process of its own
            from .disagg import PrefillWorker

            if backend != DEFAULT_BACKEND:
                raise UsageError(f"a disaggregated bundle runs here on {DEFAULT_BACKEND} only "
                                 "(on the card, serve it with `serve-config --format disagg`)")
            self.prefill_worker = PrefillWorker(bundle, manifest)
        self.decoder = build_decoder(manifest, self.target, self.draft, method, self.eos_ids,
                                     policy, self.prefill_worker)

    def sibling(self, method: str | None = None, target_only: bool = False) -> "Generator":
        """A Generator over the same sessions (nothing is loaded again) for another method the
        bundle supports, with a fresh proposer; `target_only`: neither draft nor proposer (the
        engine tells a method's proposer about accepted tokens even in target-only runs)."""
        method = method or self.method
        if method == "draft_model" and self.draft is None and not target_only:
            raise UsageError("this generator has no draft session; load the bundle with "
                             "method='draft_model'")
        g = copy.copy(self)
        g.method = method
        g.draft = self.draft if method == "draft_model" and not target_only else None
        g.decoder = build_decoder(self.manifest, self.target, g.draft,
                                  None if target_only else method, self.eos_ids,
                                  self.policy, self.prefill_worker)
        g.decoder.method = method
        return g

    def fresh_proposer(self) -> None:
        """Start the proposer over (suffix decoding's cross-request cache empty)."""
        self.decoder.proposer = new_proposer(self.manifest, self.method)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def chat_prompt(self, prompt: object, system: str | None = None) -> list[int]:
        """Token ids of a chat turn: `prompt` is a user message or a list of {"role", "content"}
        messages, rendered with the bundle's chat template and the assistant's turn opened."""
        if self._chat is None:
            self._chat = ChatTemplate(self.bundle / "tokenizer")
        text = self._chat.render(as_messages(prompt, system))
        # The template writes the special tokens itself, as in transformers' apply_chat_template.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def generate(self, prompts: list[str] | list[list[int]], max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, on_token: TokenCallback | None = None,
                 target_only: bool = False, k: int | None = None, chat: bool = False,
                 system: str | None = None, policy: str | None = None) -> GenerationResult:
        """k: one of the compiled Ks for this call only (default: the K given to `load`).
        policy: the speculation policy for this call (auto | fixed | off; default: load's).
        chat: each prompt is a user message (or a list of messages) put through the bundle's
        chat template; `system` opens each conversation that has no system message."""
        if isinstance(prompts, str) or (chat and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        if not (math.isfinite(temperature) and temperature >= 0):
            raise UsageError(f"temperature must be a finite number >= 0, got {temperature}")
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise UsageError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise UsageError(f"top_k must be >= 0, got {top_k}")
        if seed is not None and not 0 <= seed < 2**63:
            raise UsageError(f"seed must be in 0..2**63-1, got {seed}")
        for n, p in enumerate(prompts):
            if isinstance(p, str) and not p:
                raise UsageError(f"prompt {n} is empty")
        if chat:
            ids = [self.chat_prompt(p, system) for p in prompts]
        else:
            ids = [p if isinstance(p, list) else self.encode(p) for p in prompts]
        sp = SamplingParams(temperature, top_k, top_p, seed)
        if policy is not None and policy not in POLICIES:
            raise UsageError(f"unknown speculation policy '{policy}' ({' | '.join(POLICIES)})")
        log = getattr(self.decoder, "log", None)
        if log is not None:
            log.records.clear()
        rows, times = self.decoder.generate(ids, max_new_tokens, sp,
                                            self.k if k is None else k, on_token, target_only,
                                            policy)
        texts = [self.tokenizer.decode(r.tokens[len(r.prompt):]) for r in rows]
        method = "target_only" if target_only else self.method
        return GenerationResult(texts, rows, SpecDecodingStats.from_rows(rows, times, method),
                                log.to_dict() if log is not None else None)


def new_proposer(manifest: Manifest, method: str | None) -> Proposer | None:
    """The proposer of an ngram/suffix method with the bundle's options for it (its own
    method) or the defaults (another one); None for draft_model and target-only."""
    if method not in ("ngram", "suffix"):
        return None
    spd = manifest.speculation
    return make_proposer(method, spd.options if spd.method == method else {})


def eagle3_drafter(manifest: Manifest, target: ModelSession) -> Eagle3Drafter:
    """The bundle's EAGLE-3 head, beside the target's artifact (ONNX Runtime only)."""
    path = getattr(target, "path", None)
    if not isinstance(target, FeatureSession) or not target.feature_size or path is None:
        raise UsageError("eagle3 reads the features the target's ONNX Runtime graph returns, "
                         "which this session does not (the head runs on ONNX Runtime only in "
                         "this version)")
    return Eagle3Drafter(Path(path).parent / EAGLE3_DIR / GRAPH_FILE, Path(path),
                         manifest.roles["target"].arch.vocab_size, manifest.shapes.ctx_len,
                         max(manifest.ks))


def build_decoder(manifest: Manifest, target: ModelSession, draft: ModelSession | None,
                  method: str | None, eos_ids: set[int], policy: str | None = None,
                  prefill_worker: PrefillWorker | None = None) -> SpecDecoder:
    """The one way a SpecDecoder is made from a bundle: its compiled Ks, prefill chunk and
    continuous batching, with `method`'s proposer (method None: target-only, no proposer),
    and how it speculates (the bundle's policy unless `policy` says otherwise).
    prefill_worker (a disaggregated bundle): the process the target's prompts go to."""
    shapes, spd, ks = manifest.shapes, manifest.speculation, manifest.ks
    schedule = {b: k for b, k in spd.schedule.items() if k in ks}
    heads = target if method == "turbo" and isinstance(target, HeadsSession) and target.heads \
        else None
    if method == "turbo" and heads is None:
        raise UsageError("turbo proposes from heads compiled into the target's graph, which "
                         "this session does not return (ONNX Runtime runs them here; on the "
                         "card, QEfficient's turbo runner does)")
    eagle3 = eagle3_drafter(manifest, target) if method == "eagle3" else None
    args = (target, draft, new_proposer(manifest, method), ks, shapes.prefill_seq_len, eos_ids,
            method or "target_only", bool(shapes.full_batch_size))
    kwargs: dict[str, Any] = dict(policy=policy or spd.policy,
                                  draft_p_min=float(spd.draft_p_min),
                                  num_speculative_tokens_per_batch_size=schedule,
                                  prefill_tails=tuple(shapes.prefill_tail_seq_lens), heads=heads,
                                  eagle3=eagle3)
    if prefill_worker is not None:
        from .disagg import DisaggDecoder, HandoffLog

        return DisaggDecoder(*args, worker=prefill_worker, log=HandoffLog(), **kwargs)
    return SpecDecoder(*args, **kwargs)


def load(bundle: str | Path, backend: str = DEFAULT_BACKEND, method: str | None = None,
         k: int | None = None, verify: str = "full", ctx_len: int | None = None,
         batch_size: int | None = None, signed_by: str | Path | None = None,
         policy: str | None = None) -> Generator:
    """Open a bundle. verify: "full" (SHA-256 of every file), "fast" (presence and sizes, for
    huge QPCs) or "none". `ctx_len` / `batch_size`, when given, are what the caller expects the
    bundle to be compiled for: a bundle built for other shapes is refused. `signed_by`: a public
    key file; the bundle must carry a valid signature by it (needs verify="full")."""
    bundle = Path(bundle)
    if verify not in ("full", "fast", "none"):
        raise UsageError(f"verify must be full, fast or none, not '{verify}'")
    if signed_by is not None and verify != "full":
        raise UsageError("a signature vouches for the bundle id, which only full verification "
                         "ties to the files: drop --verify or use --verify full")
    sealed = SealedManifest(bundle)
    if verify != "none":
        problems = verify_bundle(bundle, fast=verify == "fast")
        if problems:
            raise BundleError(f"{bundle} does not match its manifest: " + "; ".join(problems[:5])
                              + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    if signed_by is not None:
        check_signature(bundle, sealed.bundle_id, Path(signed_by))
    manifest = sealed.checked()  # sealed is not sane: values checked
    if manifest.tokenizer.verdict == "incompatible":
        raise BundleError(f"{bundle}: target and draft tokenizers are incompatible")
    for key, want in (("ctx_len", ctx_len), ("batch_size", batch_size)):
        have = getattr(manifest.shapes, key)
        if want is not None and have != want:
            raise BundleError(f"{bundle} was compiled for {key}={have}, not {want}; "
                              f"rebuild it with --set shapes.{key}={want}")
    built_method = manifest.speculation.method
    method = method or built_method
    if method not in METHODS:
        raise UsageError(f"unknown method '{method}' ({' | '.join(METHODS)})")
    if method == "draft_model" and manifest.draft is None:
        raise UsageError(f"this bundle has no draft model (built for '{built_method}'); use "
                         "--method ngram or --method suffix")
    if method == "turbo" and not manifest.speculation.turbo_heads:
        raise UsageError(f"this bundle has no turbo heads (built for '{built_method}'); use "
                         "--method ngram or --method suffix")
    if method == "eagle3" and built_method != "eagle3":
        raise UsageError(f"this bundle has no EAGLE-3 head (built for '{built_method}'); use "
                         "--method ngram or --method suffix")
    if policy is not None and policy not in POLICIES:
        raise UsageError(f"unknown speculation policy '{policy}' ({' | '.join(POLICIES)})")
    return Generator(bundle, manifest, backend, method, k, policy)

"""Recipe -> BuildPlan: every decision `compile` will act on, made once and shown up front.

The plan needs configs, never weights, so it runs in a second on a laptop for an 8B model. It is
the single source of truth for K, shapes, core split and compiler inputs; later stages only read it.
"""
# Over 400 lines: the roles' plans and the head folders (turbo, EAGLE-3) checked against the
# target they ride on, which the roles' export keys and I/O depend on, and an EAGLE-3 head's
# own unit where it is compiled for a card.

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .version import __version__
from .models.arch import ArchSpec, arch_from_config
from .models.checkpoint import checkpoint_problems
from .models.graph_io import eagle3_head_io, graph_io
from .models.specialization import Specialization
from .errors import Problem, RecipeError, UsageError
from .backend_api import (EAGLE3_HEAD_UNIT, BackendPart, CacheKeys, DeclaredIO, RoleFacts,
                          backend_names,
                          backend_plan, model_role)
from .recipe import recipe_relative, resolve_model_path
from .recipe.placement import head_on_card, node_slots, placements, resolved_cores
from .recipe.schema import CARDS, Draft, ModelRef, Recipe
from .models.source import ModelSource, resolve
from .models.tokenizer_check import alignment
from .models.eagle3_head import Eagle3Head, Eagle3HeadInfo, read_eagle3_head, weight_shapes
from .models.turbo_heads import TurboHeadsInfo, read_turbo_heads
from .models.vocab_subset import read_vocab_subset, subset_digest

EXPORTER_VERSION = "4"  # bump when the exported graph changes for the same inputs
KV_BYTES = {"float16": 2.0, "mxint8": 33 / 32}  # mxint8: 8-bit values + one scale per 32
WEIGHT_BYTES = {"none": 2.0, "mxfp6": 25 / 32}  # the card runs fp16; mxfp6: 6 bits + scale/32


@dataclass(frozen=True)
class RoleSource:
    """Where a role's model came from, as resolved (models/source.py)."""
    ref: str
    revision: str | None
    origin: str  # local | known-models | ...
    path: str | None  # the local folder; None for a known config without weights here
    config_digest: str
    smoke_of: str | None  # random weights standing in for this model (--smoke-weights)
    recipe_ref: str  # as the recipe wrote it (relative to the recipe file): what the manifest keeps

    def folder(self) -> Path:
        """The local model folder; a build needs one (bundle/build.py checks first)."""
        if self.path is None:
            raise UsageError(f"{self.ref}: no local model folder (its config plans without "
                             "weights; a build needs them)")
        return Path(self.path)


@dataclass(frozen=True)
class RoleMemory:
    """Estimated on-card memory per device of the role's group (GiB)."""
    weights_gib: float
    kv_cache_gib: float


@dataclass(frozen=True)
class VocabSubset:
    """The draft's vocabulary subset (models/vocab_subset.py), checked when planned."""
    ref: str  # as the recipe wrote it
    path: str  # resolved
    size: int
    sha256: str


@dataclass(frozen=True)
class TurboPlan:
    """The target's turbo heads (models/turbo_heads.py), checked when planned."""
    ref: str  # as the recipe wrote it
    path: str  # resolved
    info: TurboHeadsInfo

    @property
    def options(self) -> dict[str, Any]:  # the manifest's speculation options
        return {"turbo_num_heads": self.info.num_heads,
                "turbo_num_layers": self.info.num_layers, "speculator": self.ref,
                "speculator_sha256": self.info.sha256}


@dataclass(frozen=True)
class Eagle3Plan:
    """The target's EAGLE-3 head (models/eagle3_head.py), checked when planned."""
    ref: str  # as the recipe wrote it
    path: str  # resolved
    info: Eagle3HeadInfo

    @property
    def options(self) -> dict[str, Any]:  # the manifest's speculation options
        return {"speculator": self.ref, "speculator_sha256": self.info.sha256,
                "eagle_aux_hidden_state_layer_ids": list(self.info.aux_layer_ids),
                "draft_vocab_size": self.info.draft_vocab_size}

    def read(self, arch: ArchSpec) -> Eagle3Head:
        """The head, read again (by the build) and checked to be the one the plan saw."""
        head = read_eagle3_head(Path(self.path), arch.num_layers, arch.hidden_size,
                                arch.vocab_size)
        if head.info != self.info:
            raise UsageError(f"draft.model: {self.path} changed while the bundle was being built")
        return head


@dataclass(frozen=True)
class HeadUnit:
    """A target's EAGLE-3 head compiled for a card: a unit of its own beside the target (its
    folder EAGLE3_HEAD_UNIT), placed as a draft model would be (hardware.draft)."""
    unit: str
    device_group: list[int]
    num_cores: int
    specializations: list[Specialization]
    io: DeclaredIO
    memory: RoleMemory

    def facts(self, export_key: str) -> RoleFacts:
        """What a backend plans the head's compile from (the target's export key: the head's
        card graph is made from the head folder and the target's graph)."""
        return RoleFacts(role=self.unit, cores=self.num_cores, device_group=self.device_group,
                         specializations=self.specializations, io=self.io,
                         export_key=export_key)

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "device_group": self.device_group,
                "num_cores": self.num_cores,
                "specializations": [s.model_dump() for s in self.specializations],
                "io": self.io.to_dict(), "memory": asdict(self.memory)}


@dataclass(frozen=True)
class RolePlan:
    # The unit's name in the bundle (its folder, roles.<role>): "target" | "draft", and for a
    # disaggregated recipe "prefill", the target's prefill unit (target and draft then decode)
    role: str
    source: RoleSource
    arch: ArchSpec
    ks: tuple[int, ...]  # target: compiled Ks; draft: ()
    specializations: list[Specialization]
    io: DeclaredIO
    device_group: list[int]
    num_cores: int
    # Every backend's part (backends/<name>/plan.py), by backend name: `qpcbuild plan` shows
    # them all, whichever the recipe builds for.
    backends: dict[str, BackendPart]
    memory: RoleMemory
    cache_keys: CacheKeys
    vocab_subset: VocabSubset | None = None  # draft only
    stage: str | None = None  # disaggregated: "prefill" | "decode"; None: one node does both
    turbo: TurboPlan | None = None  # target only: heads compiled into its logits
    eagle3: Eagle3Plan | None = None  # target only: its feature output and the head's graph
    eagle3_head: HeadUnit | None = None  # target only: that head's unit on a card

    @property
    def model_role(self) -> str:
        """Whose model and graph this unit runs: "target" | "draft"."""
        return model_role(self.role)

    @property
    def unit(self) -> str:
        """As the docs name units: prefill/target, decode/target, decode/draft (or the role)."""
        return f"{self.stage}/{self.model_role}" if self.stage else self.role

    def to_dict(self) -> dict[str, Any]:
        """As `qpcbuild plan --json` shows it."""
        return {**({"unit": self.unit} if self.stage else {}),
                "source": asdict(self.source), "ks": list(self.ks),
                "specializations": [s.model_dump() for s in self.specializations],
                "io": self.io.to_dict(), "device_group": self.device_group,
                "num_cores": self.num_cores,
                "backends": {n: p.to_dict() for n, p in self.backends.items()},
                "memory": asdict(self.memory), "cache_keys": self.cache_keys.to_dict(),
                "vocab_subset": self.vocab_subset and asdict(self.vocab_subset),
                **({"turbo": asdict(self.turbo)} if self.turbo else {}),
                **({"eagle3": asdict(self.eagle3)} if self.eagle3 else {}),
                **({"eagle3_head": self.eagle3_head.to_dict()} if self.eagle3_head else {}),
                "arch": self.arch.to_dict()}


@dataclass(frozen=True)
class BuildPlan:
    recipe: Recipe
    roles: tuple[RolePlan, ...]
    method: str
    method_options: dict[str, Any]
    ks: tuple[int, ...]
    tokenizer: dict[str, Any]
    cores_per_qid: list[dict[str, int]]
    memory_per_qid: list[dict[str, float]]
    dram_gib_per_qid: int
    warnings: list[str] = field(default_factory=list)

    def role(self, name: str) -> RolePlan | None:
        return next((r for r in self.roles if r.role == name), None)

    @property
    def target(self) -> RolePlan:
        return next(r for r in self.roles if r.role == "target")  # every plan has one

    def to_dict(self) -> dict[str, Any]:
        return {
            "qpcbuild_version": __version__,
            "recipe": self.recipe.to_yaml_dict(),
            "method": self.method, "method_options": self.method_options, "ks": list(self.ks),
            "tokenizer": self.tokenizer,
            "roles": {r.role: r.to_dict() for r in self.roles},
            "cores_per_qid": self.cores_per_qid, "memory_per_qid_gib": self.memory_per_qid,
            "dram_gib_per_qid": self.dram_gib_per_qid, "warnings": self.warnings,
        }


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def specializations(role: str, r: Recipe, ks: tuple[int, ...], stage: str | None = None,
                    slots: int | None = None) -> list[Specialization]:
    """The role's compiled shapes. stage (a disaggregated target): "prefill" keeps the Prefill
    entries only, "decode" the Decode ones (the draft always has both: it prefills the prompt
    on the decode node). slots: the node's KV slots, in place of full_batch_size.
    role EAGLE3_HEAD_UNIT (an EAGLE-3 head on a card): the prompt's windows as the target's, then
    the catch-up over the positions a step verified (up to K + 1) and one token per further
    draft step."""
    s = r.shapes
    fbs = s.full_batch_size and (slots or s.full_batch_size)
    prefill = {"batch_size": 1 if fbs else s.batch_size, "seq_len": s.prefill_seq_len,
               "ctx_len": s.ctx_len}
    decode_batch = fbs or s.batch_size
    if role == "target":
        prefill["num_logits_to_keep"] = 1
        decodes = [{"batch_size": decode_batch, "seq_len": k + 1, "ctx_len": s.ctx_len,
                    "num_logits_to_keep": k + 1} for k in ks]
    elif role == EAGLE3_HEAD_UNIT:
        decodes = [{"batch_size": decode_batch, "seq_len": w, "ctx_len": s.ctx_len}
                   for w in sorted({1} | {k + 1 for k in ks})]
    else:
        decodes = [] if s.prefill_seq_len == 1 and not fbs else \
            [{"batch_size": decode_batch, "seq_len": 1, "ctx_len": s.ctx_len}]
    tail_lens = sorted(s.prefill_tail_seq_lens)
    tails = [{**prefill, "seq_len": w} for w in tail_lens]
    entries = [prefill] + tails + decodes
    if fbs:
        for e in entries:
            e["full_batch_size"] = fbs
    names = ["Prefill"] + [f"Prefill_{w}" for w in tail_lens] + \
        (["Decode"] if len(decodes) == 1 else [f"Decode_{i}" for i in range(len(decodes))])
    specs = [Specialization(name=n, symbols={k: str(v) for k, v in e.items()})
             for n, e in zip(names, entries)]
    if role == "target" and stage is not None:
        return [sp for sp in specs if sp.name.startswith(stage.capitalize())]
    return specs


def _role_plan(unit: str, r: Recipe, src: ModelSource, ks: tuple[int, ...], cores: int,
               compiler: str | None, vocab_subset: VocabSubset | None = None,
               turbo: TurboPlan | None = None, eagle3: Eagle3Plan | None = None,
               head_cores: int | None = None) -> RolePlan:
    """unit: target | draft, or (disaggregated) prefill, the target's prefill unit.
    head_cores: an EAGLE-3 head compiled for a card beside the target, on that many cores."""
    role = model_role(unit)  # whose model and graph
    stage = None if r.disaggregated is None else "prefill" if unit == "prefill" else "decode"
    arch = arch_from_config(src.config, f"{src.ref}/config.json")
    hw = placements(r)[unit][1]
    cb = r.shapes.full_batch_size is not None
    smoke_of = src.config.get("qpcbuild_smoke_of")  # random weights standing in for this model
    source = RoleSource(ref=src.ref, revision=src.revision, origin=src.origin,
                        path=str(src.path) if src.path else None,
                        config_digest=src.config_digest, smoke_of=smoke_of,
                        recipe_ref=smoke_of or getattr(r, role).model)
    export_key = digest({"exporter": EXPORTER_VERSION, "config": src.config_digest,
                         "role": role, "continuous_batching": cb,
                         "dtype": r.precision.export_dtype,
                         # a subset changes the graph; its key stays as before without one
                         **({"vocab_subset": vocab_subset.sha256} if vocab_subset else {}),
                         # so do heads: keys without them stay as before
                         **({"turbo": turbo.info.sha256} if turbo else {}),
                         **({"eagle3": eagle3.info.sha256} if eagle3 else {})})
    batch = node_slots(r, unit)
    n_dev = len(hw.device_group)
    head_rows = vocab_subset.size if vocab_subset else None
    memory = RoleMemory(
        # The compiler compresses matmul weights only; the embedding table stays fp16.
        weights_gib=(arch.matmul_param_count(head_rows) * WEIGHT_BYTES[r.precision.quantization]
                     + arch.embedding_param_count * 2.0) / 2**30 / n_dev,
        kv_cache_gib=arch.kv_bytes_per_token(KV_BYTES[r.precision.kv_cache_dtype])
        * r.shapes.ctx_len * batch / 2**30 / n_dev)
    head = _head_unit(r, eagle3.info, arch, ks, head_cores) \
        if eagle3 is not None and head_cores is not None else None
    facts = RoleFacts(role=unit, cores=cores, device_group=list(hw.device_group),
                      specializations=specializations(role, r, ks, stage, node_slots(r, unit)
                                                      if stage else None),
                      io=DeclaredIO.of(graph_io(role, arch, cb,
                                                turbo.info.num_heads if turbo else 0,
                                                eagle3_features=eagle3 is not None)),
                      export_key=export_key, head=head.facts(export_key) if head else None)
    parts = {name: backend_plan(name).plan_role(r, facts, compiler) for name in backend_names()}
    # the settings part of each backend's cache key
    backend_keys = {name: digest(backend_plan(name).settings(r, facts, part))
                    for name, part in parts.items()}
    return RolePlan(
        role=unit, source=source, arch=arch, ks=ks if unit == "target" else (),
        specializations=facts.specializations, io=facts.io, device_group=facts.device_group,
        num_cores=cores, backends=parts, memory=memory,
        cache_keys=CacheKeys(export=export_key, backends=backend_keys), vocab_subset=vocab_subset,
        stage=stage, turbo=turbo, eagle3=eagle3, eagle3_head=head)


def _head_unit(r: Recipe, info: Eagle3HeadInfo, arch: ArchSpec, ks: tuple[int, ...],
               cores: int) -> HeadUnit:
    """An EAGLE-3 head's unit on a card: the draft's devices and cores, its shapes, its graph's
    I/O and its memory (its matmuls compressed as the target's, the copy of the target's
    embedding in fp16, one layer's KV)."""
    hw = placements(r)["draft"][1]
    matmuls = sum(rows * cols for name, (rows, *rest) in weight_shapes(info).items()
                  for cols in rest if name != "fc.weight")  # fc is baked into the target
    kv = 2 * info.num_kv_heads * info.head_dim * KV_BYTES[r.precision.kv_cache_dtype]
    n_dev = len(hw.device_group)
    memory = RoleMemory(
        weights_gib=(matmuls * WEIGHT_BYTES[r.precision.quantization]
                     + arch.embedding_param_count * 2.0) / 2**30 / n_dev,
        kv_cache_gib=kv * r.shapes.ctx_len * node_slots(r, "target") / 2**30 / n_dev)
    io = eagle3_head_io(info.hidden_size, info.num_kv_heads, info.head_dim,
                        info.draft_vocab_size, r.shapes.full_batch_size is not None)
    return HeadUnit(unit=EAGLE3_HEAD_UNIT, device_group=list(hw.device_group), num_cores=cores,
                    specializations=specializations(EAGLE3_HEAD_UNIT, r, ks),
                    io=DeclaredIO.of(io), memory=memory)


def _checkpoint_problems(src: ModelSource, arch: ArchSpec, ref: ModelRef | Draft) -> list[str]:
    """Weights against config, when the folder has weights (a config-only folder still plans)."""
    if src.path is None or not any(src.path.glob("*.safetensors")) and \
            not (src.path / "model.safetensors.index.json").is_file():
        return []
    return checkpoint_problems(src.path, arch, ref.allow_pickle, ref.allow_unused_weights)


def _vocab_subset(r: Recipe, ref: str, arch: ArchSpec) -> VocabSubset:
    try:
        path = recipe_relative(r, ref)
    except RuntimeError as exc:  # "~nosuchuser/x"
        raise UsageError(f"{ref}: not a usable path ({exc})") from None
    ids = read_vocab_subset(path, arch.vocab_size, arch.eos_token_ids)
    return VocabSubset(ref=ref, path=str(path.resolve()), size=int(len(ids)),
                       sha256=subset_digest(ids))


def _turbo_heads(r: Recipe, arch: ArchSpec) -> tuple[TurboPlan | None, list[Problem]]:
    """The turbo recipe's head folder, checked against the target and the compiled Ks."""
    ref = r.draft.model
    if r.draft.method != "turbo" or ref is None:
        return None, []
    try:
        path = recipe_relative(r, ref)
        info = read_turbo_heads(path, arch.hidden_size).info
    except (UsageError, RuntimeError, OSError) as exc:
        return None, [Problem("draft.model", str(exc), r.line_of("draft.model"))]
    turbo = TurboPlan(ref=ref, path=str(path.resolve()), info=info)
    if max(r.compiled_ks) > info.num_heads:
        # head h proposes the token h + 1 places ahead: a larger K is refused, never clamped
        return turbo, [Problem("speculation.num_speculative_tokens", f"K={max(r.compiled_ks)} "
                               f"exceeds the {info.num_heads} turbo heads of {ref}: each head "
                               "proposes one token, so K is at most the head count",
                               r.line_of("speculation.num_speculative_tokens"))]
    return turbo, []


def _eagle3_head(r: Recipe, arch: ArchSpec) -> tuple[Eagle3Plan | None, list[Problem]]:
    """The eagle3 recipe's head folder, checked against the target."""
    ref = r.draft.model
    if r.draft.method != "eagle3" or ref is None:
        return None, []
    try:
        path = recipe_relative(r, ref)
        info = read_eagle3_head(path, arch.num_layers, arch.hidden_size, arch.vocab_size).info
    except (UsageError, RuntimeError, OSError) as exc:
        return None, [Problem("draft.model", str(exc), r.line_of("draft.model"))]
    return Eagle3Plan(ref=ref, path=str(path.resolve()), info=info), []


def _resolve_sources(r: Recipe) -> tuple[dict[str, ModelSource], VocabSubset | None]:
    """Each role's model (its config; weights checked against it where present) and the
    draft's vocabulary subset; every problem found at once, as one RecipeError."""
    problems: list[Problem] = []
    sources: dict[str, ModelSource] = {}
    subset: VocabSubset | None = None
    refs: dict[str, tuple[str | None, str | None, str]] = {
        "target": (r.target.model, r.target.revision, "target.model")}
    if r.draft.method == "draft_model":  # (the recipe's checks made sure it names a model)
        refs["draft"] = (r.draft.model, r.draft.revision, "draft.model")
    for role, (ref, rev, key) in refs.items():
        if ref is None:
            continue
        try:
            sources[role] = resolve(resolve_model_path(r, ref), rev)
            arch = arch_from_config(sources[role].config, f"{ref}/config.json")
            problems += [Problem(key, f"{sources[role].path}: {p}", r.line_of(key))
                         for p in _checkpoint_problems(sources[role], arch, getattr(r, role))]
        except UsageError as exc:
            problems.append(Problem(key, str(exc), r.line_of(key)))
            continue
        if role == "draft" and r.draft.vocab_subset:
            try:
                subset = _vocab_subset(r, r.draft.vocab_subset, arch)
            except UsageError as exc:
                problems.append(Problem("draft.vocab_subset", str(exc),
                                        r.line_of("draft.vocab_subset")))
        if r.shapes.ctx_len > arch.max_position_embeddings:
            problems.append(Problem("shapes.ctx_len", f"{r.shapes.ctx_len} exceeds the {role}'s "
                                    f"max_position_embeddings ({arch.max_position_embeddings}), "
                                    "the longest context it was trained for",
                                    r.line_of("shapes.ctx_len")))
        if arch.rope_ctx_limit and r.shapes.ctx_len > arch.rope_ctx_limit:
            problems.append(Problem("shapes.ctx_len", f"{r.shapes.ctx_len} exceeds the {role}'s "
                                    f"original_max_position_embeddings ({arch.rope_ctx_limit}): "
                                    "past it longrope changes every position's rotation, which "
                                    "a retained KV cache cannot follow; keep ctx_len within it",
                                    r.line_of("shapes.ctx_len")))
        for backend in r.backends:
            problems += backend_plan(backend).problems(r, role, arch)
    if problems:
        raise RecipeError(r.source, problems)
    return sources, subset


def _per_qid(roles: list[RolePlan], card: dict[str, Any],
             warnings: list[str]) -> tuple[list[dict[str, int]], list[dict[str, float]]]:
    """Cores and memory per device (QID) the roles use; a warning where a QID's memory does not
    hold its weights and KV cache."""
    # (an EAGLE-3 head on a card is a unit of its own: its column "eagle3_head")
    units = [(rp.role, rp.device_group, rp.num_cores, rp.memory) for rp in roles] + \
        [("eagle3_head", h.device_group, h.num_cores, h.memory) for rp in roles
         if (h := rp.eagle3_head) is not None]
    qids = sorted({q for _, group, _, _ in units for q in group})
    # (nodes on distinct hosts may both name QID 0: the rows then add up two machines)
    core_rows: list[dict[str, int]] = []
    mem_rows: list[dict[str, float]] = []
    for q in qids:
        row = {"qid": q, **{name: cores if q in group else 0 for name, group, cores, _ in units}}
        row["free"] = card["cores_per_qid"] - sum(row.get(name, 0) for name, *_ in units)
        core_rows.append(row)
        mem: dict[str, float] = {"qid": q}
        for name, group, _, memory in units:
            if q in group:
                mem[f"{name}_weights"] = round(memory.weights_gib, 3)
                mem[f"{name}_kv"] = round(memory.kv_cache_gib, 3)
        mem["total"] = round(sum(v for k, v in mem.items() if k != "qid"), 3)
        mem_rows.append(mem)
        if mem["total"] > card["dram_gib_per_qid"]:
            warnings.append(f"QID {q}: estimated {mem['total']:.1f} GiB of weights and KV cache "
                            f"exceed its {card['dram_gib_per_qid']} GiB of on-board memory")
    return core_rows, mem_rows


def make_plan(r: Recipe, compiler: str | None = None, memo_dir: Path | None = None) -> BuildPlan:
    """Resolve models (configs only), check what needs them, and decide everything.
    `memo_dir`: where checks of unchanged files are remembered (the cache's digests folder)."""
    sources, subset = _resolve_sources(r)
    target_arch = arch_from_config(sources["target"].config, r.target.model)
    turbo, problems = _turbo_heads(r, target_arch)
    eagle3, more = _eagle3_head(r, target_arch)
    problems += more
    if problems:
        raise RecipeError(r.source, problems)
    warnings = [str(w) for w in r.warnings]
    configs = {role: src.config for role, src in sources.items()}
    for name in backend_names():  # (in the registry's order, as before)
        if name in r.backends:
            warnings += backend_plan(name).warnings(r, configs)
    tok = alignment(sources["target"], sources.get("draft"), memo_dir)
    if tok["verdict"] == "incompatible":
        raise RecipeError(r.source, [Problem("draft.model", "target and draft "
                          f"tokenizers are incompatible: {tok['detail']}", r.line_of("draft.model"))])
    if tok["verdict"] in ("unverified", "same-family"):
        warnings.append(f"tokenizers: {tok['detail']}")
    vocab = {role: src.config.get("vocab_size") for role, src in sources.items()}
    if "draft" in vocab and vocab["target"] != vocab["draft"]:
        # vllm/config/speculative.py, verify_equal_vocab_size_if_draft_model (vLLM 0.32)
        warnings.append(f"vocab_size: target {vocab['target']}, draft {vocab['draft']} (the "
                        "target's padded); qpcbuild runs this pair, but vLLM's draft_model "
                        "method requires equal sizes unless use_heterogeneous_vocab is set "
                        "(greedy drafting only)")

    cores = resolved_cores(r)
    roles = [_role_plan("target", r, sources["target"], r.compiled_ks, cores["target"],
                        compiler, turbo=turbo, eagle3=eagle3,
                        head_cores=cores["draft"] if head_on_card(r) else None)]
    if r.disaggregated is not None:  # the target's prefill unit: the same export, its own node
        roles.insert(0, _role_plan("prefill", r, sources["target"], r.compiled_ks,
                                   cores["prefill"], compiler))
    if "draft" in sources:
        roles.append(_role_plan("draft", r, sources["draft"], (), cores["draft"], compiler,
                                subset))
        t, d = roles[-2].arch.param_count, roles[-1].arch.param_count
        if d >= t:
            warnings.append(f"draft.model: the draft ({d:,} parameters) is not smaller than the "
                            f"target ({t:,}); speculation will not pay off")

    card = CARDS[r.hardware.card]
    core_rows, mem_rows = _per_qid(roles, card, warnings)
    return BuildPlan(recipe=r, roles=tuple(roles), method=r.draft.method,
                     method_options=turbo.options if turbo else eagle3.options if eagle3
                     else r.method_options,
                     ks=r.compiled_ks, tokenizer=tok,
                     cores_per_qid=core_rows, memory_per_qid=mem_rows,
                     dram_gib_per_qid=card["dram_gib_per_qid"], warnings=warnings)

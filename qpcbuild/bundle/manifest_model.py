"""The typed bundle manifest: what manifest.json may contain, checked field by field and across
fields, with the facts recorded once and the rest derived. manifest.py seals, reads and writes
it; every other module reads a `Manifest`'s attributes, never the JSON by key. Its JSON Schema is
docs/manifest-schema.json (scripts/manifest_schema.py)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, TypeVar, Union, get_args

from pydantic import (AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, GetJsonSchemaHandler,
                      SerializeAsAny, TypeAdapter, ValidationError, field_validator)

from ..backend_api import BACKENDS, BackendEntry, entry_model
from ..errors import BundleError
from ..models.specialization import Specialization
from ..recipe.schema import Method
from .handoff import Disaggregated, contract_problems, unit_facts

E = TypeVar("E", bound=BackendEntry)

# 3: Ks and shapes recorded once (no roles.*.compiled_ks, no ort shapes)
SchemaVersion = Literal[3]
MANIFEST_SCHEMA: int = get_args(SchemaVersion)[0]

# ---------------------------------------------------------------- the typed manifest
# What the runtime relies on, typed and bounded. The seal says a manifest was not changed since
# it was sealed, not that what was sealed is sane: anyone who can write a bundle can re-seal an
# edit, so every value a reader acts on is checked here before anything is loaded. Fields not
# declared are kept (extra="allow"), so readers can move onto this model one at a time.
class _Part(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


class Shapes(_Part):
    batch_size: int = Field(ge=1, le=4096)
    full_batch_size: Optional[int] = Field(default=None, ge=1, le=4096)
    prefill_seq_len: int = Field(ge=1)
    ctx_len: int = Field(ge=2, le=1 << 21)
    # narrower windows compiled for a prompt's last prefill chunk; absent in bundles without
    prefill_tail_seq_lens: list[int] = []

    @property
    def kv_batch(self) -> int:
        """Rows of the KV cache: the continuous-batching slots, else the batch size."""
        return self.full_batch_size or self.batch_size


class Speculation(_Part):
    method: Method
    options: dict[str, Any] = {}
    # The compiled Ks: the one place a bundle records them (the target decodes K+1 per step).
    num_speculative_tokens: list[int] = Field(min_length=1)
    # docs/adaptive.md; absent in bundles built with the defaults
    policy: Literal["auto", "fixed", "off"] = "fixed"
    draft_p_min: float = Field(default=0.0, ge=0, le=1)
    # live batch size (as text) -> K: vLLM's name, the recipe's; bundles built before it had
    # one name across recipe, manifest and runtime recorded it as k_schedule (read as before)
    num_speculative_tokens_per_batch_size: Optional[dict[str, int]] = Field(
        default=None, validation_alias=AliasChoices("num_speculative_tokens_per_batch_size",
                                                    "k_schedule"))

    @field_validator("num_speculative_tokens_per_batch_size")
    @classmethod
    def _batch_sizes(cls, v: Optional[dict[str, int]]) -> Optional[dict[str, int]]:
        bad = [b for b in v or {} if not (b.isascii() and b.isdigit() and 0 < int(b) <= 4096)]
        if bad:
            raise ValueError(f"batch size {bad[0]!r} must be a whole number in 1..4096")
        return v

    @property
    def turbo_heads(self) -> int:
        """The turbo heads compiled into the target's logits (0: none)."""
        heads = self.options.get("turbo_num_heads", 0) if self.method == "turbo" else 0
        return heads if isinstance(heads, int) else 0

    @property
    def schedule(self) -> dict[int, int]:
        """num_speculative_tokens_per_batch_size with batch sizes as numbers."""
        return {int(b): k for b, k in (self.num_speculative_tokens_per_batch_size or {}).items()}


class Arch(_Part):
    architecture: str = ""
    num_layers: int = Field(ge=1, le=1024)
    num_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=65536)
    vocab_size: int = Field(ge=1, le=1 << 24)
    param_count: int = Field(ge=0)
    eos_token_ids: list[int]


class GraphIO(_Part):
    name: str
    dtype: str
    shape: list[Union[int, str]]


class RoleIO(_Part):
    """The role's graph inputs and outputs as the plan declared them (symbolic dims as names)."""
    inputs: list[GraphIO] = []
    outputs: list[GraphIO] = []


class Source(_Part):
    ref: str
    revision: Optional[str] = None
    origin: Optional[str] = None
    weights_digest: Optional[str] = None
    smoke_weights: bool = False
    # Never sealed: where this machine holds the model (Manifest.with_model_paths, for bench).
    path: Optional[str] = None


class Precision(_Part):
    weights: str = "none"
    kv_cache: str = "float16"


class OrtRole(_Part):
    """How the runtime drives a role's ONNX Runtime artifact (its shapes are the bundle's);
    every role records it (backends/onnxruntime/plan.py, OrtPart.manifest_role_fields)."""
    core_share: float = Field(gt=0, le=1)
    intra_op_threads: Optional[int] = Field(default=None, ge=1, le=1024)


def _backend_entries(v: Any) -> Any:
    """Each backend's entry checked against its own model, picked by the backend's name (the
    key): the registry's backends are the union this field accepts."""
    if not isinstance(v, dict):
        return v  # pydantic says what is wrong
    out = {}
    for name, entry in v.items():
        if isinstance(entry, BackendEntry):
            out[name] = entry
            continue
        if name not in BACKENDS:
            raise ValueError(f"unknown backend '{name}' ({' | '.join(BACKENDS)})")
        # checked under its name, so an error says where: backends.<name>.<field>
        out[name] = _entries_of(name).validate_python({name: entry})[name]
    return out


class _EntriesSchema:
    """The JSON Schema of roles.<role>.backends: each registered backend's entry, by its name
    (docs/manifest-schema.json)."""

    @staticmethod
    def __get_pydantic_json_schema__(schema: Any, handler: GetJsonSchemaHandler) -> Any:
        return {"type": "object", "additionalProperties": False,
                "properties": {name: handler(entry_model(name).__pydantic_core_schema__)
                               for name in BACKENDS}}


@lru_cache(maxsize=None)
def _entries_of(name: str) -> TypeAdapter[dict[str, BackendEntry]]:
    # (the entry's class is known at run time only)
    return TypeAdapter(dict[str, entry_model(name)])  # type: ignore[arg-type, misc]


class Role(_Part):
    source: Source
    arch: Arch
    io: RoleIO = RoleIO()
    specializations: list[Specialization] = Field(min_length=1)
    num_cores: Optional[int] = None
    device_group: list[int] = []
    precision: Precision = Precision()
    ort: Optional[OrtRole] = None
    # backend name -> its entry (backends/<name>/manifest.py), for the backends it was built for
    # (SerializeAsAny: an entry is written with its own model's fields, not the base's)
    backends: Annotated[dict[str, SerializeAsAny[BackendEntry]],
                        BeforeValidator(_backend_entries), _EntriesSchema()]

    def built(self, kind: type[E]) -> E | None:
        """The role's entry of that model (e.g. backends.qaic.manifest.QaicEntry); None where
        the role was not built for its backend."""
        return next((e for e in self.backends.values() if isinstance(e, kind)), None)

    def matmul_weights(self) -> str | None:
        """The role's matmul weight format on the host (float32 | int8 | int4), or None where
        no artifact of it runs on the host (the card's formats are the role's precision)."""
        return next((w for e in self.backends.values() if (w := e.matmul_weights())), None)


class TokenizerInfo(_Part):
    files: str = "tokenizer/"
    verdict: str
    detail: str = ""


class FileEntry(_Part):
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    executable: bool = False


class TunedBatch(_Part):
    batch_size: int
    chosen_k: int


class Tuning(_Part):
    """`compile --tune`'s evidence for the chosen K (tune/); typed where a reader acts on it."""
    per_batch: Optional[list[TunedBatch]] = None


class Manifest(_Part):
    """A bundle's manifest, checked field by field and across fields (see _disagreements).
    The one place that knows the JSON: everything else reads attributes."""

    schema_version: SchemaVersion = Field(alias="schema")
    bundle_id: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")  # None: unsealed
    name: str = Field(min_length=1)
    speculation: Speculation
    shapes: Shapes
    hardware: dict[str, Any] = {}
    backends: list[str] = []
    # prefill: a disaggregated bundle's prefill unit of the target (target and draft decode)
    roles: dict[Literal["target", "draft", "prefill"], Role]
    disaggregated: Optional[Disaggregated] = None  # absent: one node runs both stages
    tokenizer: TokenizerInfo
    toolchain: dict[str, Any] = {}
    files: dict[str, FileEntry] = {}
    tuning: Optional[Tuning] = None
    seal: Optional[dict[str, Any]] = None

    # -------------------------------------------------------- derived facts
    @property
    def ks(self) -> tuple[int, ...]:
        """The compiled Ks (speculation.num_speculative_tokens), in increasing order."""
        return tuple(self.speculation.num_speculative_tokens)

    @property
    def target(self) -> Role:
        return self.roles["target"]

    @property
    def draft(self) -> Optional[Role]:
        return self.roles.get("draft")

    def target_weights_label(self) -> str | None:
        """One phrase saying the target is not the float32 model (None when it is, or when no
        target artifact runs on the host): what run, bench and serve print next to numbers."""
        fmt = self.target.matmul_weights()
        if fmt in (None, "float32"):
            return None
        return (f"target weights {fmt} blocks (not the float32 target: output differs from it; "
                "see bench --numerics)")

    def to_json_dict(self) -> dict[str, Any]:
        """The manifest exactly as its JSON holds it (fields a file leaves out stay out)."""
        never_sealed: dict[str, Any] = {"roles": {r: {"source": {"path"}} for r in self.roles}}
        out: dict[str, Any] = self.model_dump(mode="json", by_alias=True, exclude_unset=True,
                                              exclude=never_sealed)
        return out

    def file_list(self) -> dict[str, dict[str, Any]]:
        """path -> {size, sha256[, executable]} as the JSON records them."""
        files: dict[str, dict[str, Any]] = self.to_json_dict()["files"]
        return files

    def with_model_paths(self, paths: dict[str, Path]) -> "Manifest":
        """The same manifest with each role's local model folder known (never sealed)."""
        roles = {name: role.model_copy(update={"source": role.source.model_copy(
            update={"path": str(paths[name])})}) if name in paths else role
            for name, role in self.roles.items()}
        return self.model_copy(update={"roles": roles})

    def with_built(self, backend: str, entries: dict[str, dict[str, Any]],
                   files: dict[str, dict[str, Any]], toolchain: dict[str, Any]) -> "Manifest":
        """An unsealed copy in which each role of `entries` records what `backend` built for
        it (fields merged into its entry; `finish` adopting QPCs), the file list is `files` and
        `toolchain` is merged into the toolchain record."""
        raw = self.to_json_dict()  # (sealing drops the old id and seal)
        for role, update in entries.items():
            raw["roles"][role]["backends"][backend].update(update)
        raw["toolchain"].update(toolchain)
        raw["files"] = files
        return Manifest.unsealed(raw)

    @classmethod
    def unsealed(cls, raw: dict[str, Any]) -> "Manifest":
        """A manifest being built (no id or seal yet), checked like a sealed one."""
        return cls.check(json.loads(json.dumps(raw)), "the manifest being written")

    @classmethod
    def check(cls, raw: dict[str, Any], source: str) -> "Manifest":
        """The typed manifest, or BundleError naming the first field that is wrong."""
        try:
            m = cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise BundleError(f"{source}: manifest field {where}: {first['msg']}") from None
        problems = m._disagreements()
        if problems:
            raise BundleError(f"{source}: the manifest contradicts itself: "
                              + "; ".join(problems[:3]))
        return m

    def _disagreements(self) -> list[str]:
        out: list[str] = []
        shapes, ks = self.shapes, self.speculation.num_speculative_tokens
        if "target" not in self.roles:
            out.append("roles has no target")
            return out
        if (self.speculation.method == "draft_model") != ("draft" in self.roles):
            out.append(f"speculation.method {self.speculation.method} "
                       + ("needs a draft role" if "draft" not in self.roles else
                          "takes no draft role"))
        if ks != sorted(set(ks)) or ks[0] < 0 or ks[-1] + 1 >= shapes.ctx_len:
            out.append(f"speculation.num_speculative_tokens {ks}: expected distinct Ks in "
                       f"increasing order, each in 0..{shapes.ctx_len - 2}")
        off_list = {b: k for b, k in self.speculation.schedule.items() if k not in ks}
        if off_list:
            b, k = next(iter(off_list.items()))
            out.append(f"speculation.num_speculative_tokens_per_batch_size {b}: K={k} is not "
                       f"among speculation.num_speculative_tokens {ks}")
        if shapes.prefill_seq_len > shapes.ctx_len:
            out.append(f"shapes.prefill_seq_len {shapes.prefill_seq_len} exceeds ctx_len "
                       f"{shapes.ctx_len}")
        if any(not 1 <= w < shapes.prefill_seq_len for w in shapes.prefill_tail_seq_lens):
            out.append(f"shapes.prefill_tail_seq_lens {shapes.prefill_tail_seq_lens}: each "
                       f"must be narrower than prefill_seq_len {shapes.prefill_seq_len}")
        if self.draft is not None and self.draft.arch.vocab_size > self.target.arch.vocab_size:
            out.append("roles.draft.arch.vocab_size exceeds the target's")
        dis = self.disaggregated
        if ("prefill" in self.roles) != (dis is not None):
            out.append("roles.prefill and disaggregated: a disaggregated bundle has both, "
                       "others neither")
        if dis is not None:
            out += contract_problems(dis, self.roles)
        for name, role in self.roles.items():
            # a disaggregated unit has its node's slots, and only its stage's shapes
            slots = unit_facts(role)["slots"] if dis is not None else shapes.kv_batch
            out += _role_disagreements(name, role, shapes, ks if name == "target" else [],
                                       slots, tails=dis is None or name != "target")
        return out


def _role_disagreements(name: str, role: Role, shapes: Shapes, ks: list[int], slots: int,
                        tails: bool = True) -> list[str]:
    where, out = f"roles.{name}", []
    for spec in role.specializations:
        if spec.size("ctx_len") != shapes.ctx_len:
            out.append(f"{where}.specializations {spec.name}: ctx_len {spec.size('ctx_len')} "
                       f"is not shapes.ctx_len {shapes.ctx_len}")
        if spec.size("batch_size") not in (1, shapes.batch_size, slots):
            out.append(f"{where}.specializations {spec.name}: batch_size "
                       f"{spec.size('batch_size')} is not the bundle's")
    seq_lens = {spec.size("seq_len") for spec in role.specializations}
    missing = [k for k in ks if k + 1 not in seq_lens]
    if missing:
        out.append(f"{where}.specializations: none decodes K={missing[0]} (seq_len "
                   f"{missing[0] + 1})")
    missing_tails = [w for w in shapes.prefill_tail_seq_lens if tails and w not in seq_lens]
    if missing_tails:
        out.append(f"{where}.specializations: none prefills through shapes."
                   f"prefill_tail_seq_lens {missing_tails[0]}")
    for backend, entry in role.backends.items():
        out += [f"{where}: {p}" for p in entry.problems(role.model_dump())]
    if any(not 0 <= e < role.arch.vocab_size for e in role.arch.eos_token_ids):
        out.append(f"{where}.arch.eos_token_ids: outside the vocabulary")
    return out

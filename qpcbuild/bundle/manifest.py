"""The bundle manifest: what it may contain, how it is sealed, how it is read.

The bundle id is the SHA-256 of the manifest's canonical JSON with two keys left out: the id
itself and `seal`. Because `files` (path, size, SHA-256 and exec bit of every other file) is part
of that content, the id covers every byte of the bundle and every field that describes it.
`seal.fields` holds a short digest of each field at sealing time; it is only a diagnostic, so
that `verify` can name the field that changed. A manifest whose fields and seal were both
rewritten hashes to a new id: compare the id with the one your build reported (or check a
signature) to detect that.

Nothing host-specific goes in: no absolute paths, no build time, no command line, no host name,
so one recipe, one set of weights and one toolchain give one id on every machine.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import BundleError, UsageError

MANIFEST = "manifest.json"
SIGNATURES = "signatures.json"  # beside the manifest, outside what it seals (signature.py)
UNSEALED_FILES = (MANIFEST, SIGNATURES)  # the bundle's files its file list leaves out
MANIFEST_SCHEMA = 2
SEAL_ALGORITHM = "sha256-canonical-json"
UNSEALED = ("bundle_id", "seal")
# Keys whose string values are paths inside the bundle (files or folders).
PATH_KEYS = frozenset({"artifact", "compile_script", "inputs", "qpc", "log", "qpc_files"})
_SHA256 = re.compile(r"[0-9a-f]{64}")


def canonical(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def _content(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest.items() if k not in UNSEALED}


def content_id(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(_content(manifest))).hexdigest()


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) for every non-dict value; a file entry counts as one leaf."""
    if isinstance(obj, dict) and obj and (prefix == "files." or not prefix.startswith("files.")):
        for key in sorted(obj):
            yield from leaves(obj[key], f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), obj


def _field_digests(manifest: dict[str, Any]) -> dict[str, str]:
    return {path: hashlib.sha256(canonical(value)).hexdigest()[:16]
            for path, value in leaves(_content(manifest))}


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """The same manifest with `bundle_id` and `seal` computed from its content."""
    check_structure(manifest, "manifest")
    out = _content(manifest)
    rest = {k: v for k, v in out.items() if k != "schema"}  # schema and id first, for readers
    return {"schema": out["schema"], "bundle_id": content_id(out), **rest,
            "seal": {"algorithm": SEAL_ALGORITHM, "fields": _field_digests(out)}}


def changed_fields(manifest: dict[str, Any]) -> list[str]:
    """Problems with the seal: fields edited, added or removed since sealing."""
    if content_id(manifest) == manifest.get("bundle_id"):
        return []
    recorded = (manifest.get("seal") or {}).get("fields")
    if not isinstance(recorded, dict):
        return ["manifest: the content does not hash to bundle_id and the seal is missing"]
    now = _field_digests(manifest)
    found = [f"manifest field changed: {p}" for p in sorted(now) if p in recorded
             and recorded[p] != now[p]]
    found += [f"manifest field added: {p}" for p in sorted(set(now) - set(recorded))]
    found += [f"manifest field removed: {p}" for p in sorted(set(recorded) - set(now))]
    return found or ["manifest: bundle_id was edited, or the seal's field digests were "
                     "(the content itself matches the seal)"]


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Seal and write atomically; returns the sealed manifest."""
    sealed = seal(manifest)
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(sealed, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(folder / MANIFEST)
    return sealed


# ---------------------------------------------------------------- reading
def check_relative(path: Any, where: str) -> str:
    """A path that stays inside the bundle: relative, POSIX, no '..', no empty parts."""
    if not isinstance(path, str) or not path:
        raise BundleError(f"manifest field {where}: expected a path inside the bundle, got "
                          f"{path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute() or "\\" in path or ".." in pure.parts or path.startswith("~") \
            or ":" in pure.parts[0]:
        raise BundleError(f"manifest field {where}: '{path}' points outside the bundle; every "
                          "path in a manifest must be relative to the bundle root")
    return path


def _paths(m: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(field path, value) of every path a backend entry names."""
    yield "tokenizer.files", m["tokenizer"].get("files")
    for role, info in m["roles"].items():
        for backend, entry in info["backends"].items():
            if not isinstance(entry, dict):
                raise BundleError(f"manifest field roles.{role}.backends.{backend}: expected "
                                  "a JSON object")
            for key in sorted(PATH_KEYS & set(entry)):
                value, where = entry[key], f"roles.{role}.backends.{backend}.{key}"
                if isinstance(value, list):
                    yield from ((f"{where}[{n}]", v) for n, v in enumerate(value))
                elif value is not None:
                    yield where, value


def check_structure(m: Any, source: str) -> None:
    """Types and paths a reader relies on; raises BundleError naming the field."""
    if not isinstance(m, dict):
        raise BundleError(f"{source}: the manifest is not a JSON object")
    for key, kind in (("name", str), ("roles", dict), ("files", dict), ("shapes", dict),
                      ("speculation", dict), ("tokenizer", dict)):
        if not isinstance(m.get(key), kind):
            raise BundleError(f"{source}: manifest field {key} is missing or not a "
                              f"{'JSON object' if kind is dict else 'string'}")
    for path, meta in m["files"].items():
        check_relative(path, f"files.{path}")
        if not (isinstance(meta, dict) and isinstance(meta.get("size"), int)
                and isinstance(meta.get("sha256"), str) and _SHA256.fullmatch(meta["sha256"])):
            raise BundleError(f"{source}: manifest field files.{path}: expected "
                              "{\"size\": int, \"sha256\": 64 hex digits}")
    for role, info in m["roles"].items():
        if not isinstance(info, dict) or not isinstance(info.get("backends"), dict):
            raise BundleError(f"{source}: manifest field roles.{role}.backends is missing")
    for where, path in _paths(m):
        check_relative(path, where)
        if where.endswith(("artifact", "compile_script", "log", "]")) and \
                path not in m["files"]:
            raise BundleError(f"{source}: manifest field {where}: '{path}' is not one of the "
                              "bundle's files")


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

    @property
    def kv_batch(self) -> int:
        """Rows of the KV cache: the continuous-batching slots, else the batch size."""
        return self.full_batch_size or self.batch_size


class Speculation(_Part):
    method: Literal["draft_model", "ngram", "suffix"]
    options: dict[str, Any] = {}
    num_speculative_tokens: list[int] = Field(min_length=1)
    # docs/adaptive.md; absent in bundles built with the defaults
    policy: Literal["auto", "fixed", "off"] = "fixed"
    draft_p_min: float = Field(default=0.0, ge=0, le=1)
    k_schedule: Optional[dict[str, int]] = None  # live batch size (as text) -> K

    @field_validator("k_schedule")
    @classmethod
    def _batch_sizes(cls, v: Optional[dict[str, int]]) -> Optional[dict[str, int]]:
        bad = [b for b in v or {} if not (b.isascii() and b.isdigit() and 0 < int(b) <= 4096)]
        if bad:
            raise ValueError(f"batch size {bad[0]!r} must be a whole number in 1..4096")
        return v


class Arch(_Part):
    num_layers: int = Field(ge=1, le=1024)
    num_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=65536)
    vocab_size: int = Field(ge=1, le=1 << 24)
    param_count: int = Field(ge=0)
    eos_token_ids: list[int]


class Specialization(_Part):
    name: str
    symbols: dict[str, str]

    @field_validator("symbols")
    @classmethod
    def _sizes(cls, v: dict[str, str]) -> dict[str, str]:
        missing = {"batch_size", "seq_len", "ctx_len"} - set(v)
        if missing:
            raise ValueError(f"lacks {', '.join(sorted(missing))}")
        bad = [k for k, n in v.items() if not (n.isascii() and n.isdigit() and 0 < int(n) < 1 << 24)]
        if bad:
            raise ValueError(f"{bad[0]} must be a positive whole number, got {v[bad[0]]!r}")
        return v

    def size(self, symbol: str) -> int:
        return int(self.symbols[symbol])


class OrtRole(_Part):
    artifact: str
    batch_size: int = Field(ge=1)
    ctx_len: int = Field(ge=2)
    core_share: float = Field(gt=0, le=1)
    intra_op_threads: Optional[int] = Field(default=None, ge=1, le=1024)


class OrtBackend(_Part):
    status: Literal["compiled"]
    artifact: str
    kv_binding: Literal["in_place", "ping_pong"] = "ping_pong"
    weights: Literal["float32", "int8", "int4"] = "float32"  # the fused graph's matmul weights


class QaicBackend(_Part):
    status: Literal["emitted", "compiled"]
    qpc: Optional[str] = None


class Backends(_Part):
    onnxruntime: Optional[OrtBackend] = None
    qaic: Optional[QaicBackend] = None


class Role(_Part):
    arch: Arch
    specializations: list[Specialization] = Field(min_length=1)
    compiled_ks: list[int]
    ort: Optional[OrtRole] = None
    backends: Backends


class TokenizerInfo(_Part):
    verdict: str


class Manifest(_Part):
    """A bundle's manifest, checked field by field and across fields (see _disagreements)."""

    schema_version: Literal[2] = Field(alias="schema")
    bundle_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str = Field(min_length=1)
    speculation: Speculation
    shapes: Shapes
    roles: dict[Literal["target", "draft"], Role]
    tokenizer: TokenizerInfo

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
        target = self.roles["target"]
        if target.compiled_ks != ks:
            out.append(f"roles.target.compiled_ks {target.compiled_ks} differs from "
                       f"speculation.num_speculative_tokens {ks}")
        if ks != sorted(set(ks)) or ks[0] < 0 or ks[-1] + 1 >= shapes.ctx_len:
            out.append(f"speculation.num_speculative_tokens {ks}: expected distinct Ks in "
                       f"increasing order, each in 0..{shapes.ctx_len - 2}")
        schedule = self.speculation.k_schedule or {}
        off_list = {b: k for b, k in schedule.items() if k not in ks}
        if off_list:
            b, k = next(iter(off_list.items()))
            out.append(f"speculation.k_schedule {b}: K={k} is not among "
                       f"speculation.num_speculative_tokens {ks}")
        if shapes.prefill_seq_len > shapes.ctx_len:
            out.append(f"shapes.prefill_seq_len {shapes.prefill_seq_len} exceeds ctx_len "
                       f"{shapes.ctx_len}")
        if "draft" in self.roles and self.roles["draft"].arch.vocab_size > \
                target.arch.vocab_size:
            out.append("roles.draft.arch.vocab_size exceeds the target's")
        for name, role in self.roles.items():
            out += _role_disagreements(name, role, shapes, ks if name == "target" else [])
        return out


def _role_disagreements(name: str, role: Role, shapes: Shapes, ks: list[int]) -> list[str]:
    where, out = f"roles.{name}", []
    for spec in role.specializations:
        if spec.size("ctx_len") != shapes.ctx_len:
            out.append(f"{where}.specializations {spec.name}: ctx_len {spec.size('ctx_len')} "
                       f"is not shapes.ctx_len {shapes.ctx_len}")
        if spec.size("batch_size") not in (1, shapes.batch_size, shapes.kv_batch):
            out.append(f"{where}.specializations {spec.name}: batch_size "
                       f"{spec.size('batch_size')} is not the bundle's")
    seq_lens = {spec.size("seq_len") for spec in role.specializations}
    missing = [k for k in ks if k + 1 not in seq_lens]
    if missing:
        out.append(f"{where}.specializations: none decodes K={missing[0]} (seq_len "
                   f"{missing[0] + 1})")
    ort = role.backends.onnxruntime
    if ort is not None and (role.ort is None or role.ort.artifact != ort.artifact):
        out.append(f"{where}.ort.artifact is not backends.onnxruntime.artifact")
    if role.backends.qaic is not None and role.backends.qaic.status == "compiled" and \
            not role.backends.qaic.qpc:
        out.append(f"{where}.backends.qaic: compiled, but names no qpc")
    if role.ort is not None and (role.ort.ctx_len, role.ort.batch_size) != \
            (shapes.ctx_len, shapes.kv_batch):
        out.append(f"{where}.ort: built for ctx_len {role.ort.ctx_len}, batch "
                   f"{role.ort.batch_size}; shapes say {shapes.ctx_len}, {shapes.kv_batch}")
    if any(not 0 <= e < role.arch.vocab_size for e in role.arch.eos_token_ids):
        out.append(f"{where}.arch.eos_token_ids: outside the vocabulary")
    return out


def read_manifest(bundle: Path, check_values: bool = True) -> dict[str, Any]:
    """The manifest of a bundle folder, structurally checked and (check_values) its values
    checked by the typed Manifest. Verification turns the value check off, to report a broken
    seal first: an edit that was not re-sealed is named by the field it changed."""
    bundle = Path(bundle)
    path = bundle / MANIFEST
    # A wrong argument is bad input (exit 2); a damaged bundle is a bundle failure (exit 1).
    if not bundle.is_dir():
        raise UsageError(f"{bundle}: " + ("not a folder (a bundle is the folder `qpcbuild "
                                          "compile` writes; use `qpcbuild unpack` for a .tar.gz)"
                                          if bundle.exists() else "no such bundle folder"))
    if not path.is_file():
        raise UsageError(f"{bundle}: no {MANIFEST}; not a qpcbuild bundle")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BundleError(f"{path}: corrupted manifest ({exc})") from None
    schema = manifest.get("schema") if isinstance(manifest, dict) else None
    if schema != MANIFEST_SCHEMA:
        hint = "; rebuild it with this qpcbuild" if isinstance(schema, int) and \
            schema < MANIFEST_SCHEMA else ""
        raise BundleError(f"{path}: manifest schema {schema!r} is not supported (this qpcbuild "
                          f"reads schema {MANIFEST_SCHEMA}){hint}")
    check_structure(manifest, str(path))
    if check_values:
        Manifest.check(manifest, str(path))
    return manifest

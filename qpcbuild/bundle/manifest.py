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
from typing import Any, Iterator

from ..errors import BundleError, UsageError
from ..smallfile import read_small_file
# The typed model, importable from here too (readers need only this module's name): `X as X`
# marks each as this module's export.
from .manifest_model import MANIFEST_SCHEMA as MANIFEST_SCHEMA
from .manifest_model import GraphIO as GraphIO
from .manifest_model import Manifest as Manifest
from .manifest_model import Role as Role
from .manifest_model import RoleIO as RoleIO

MANIFEST = "manifest.json"
SIGNATURES = "signatures.json"  # beside the manifest, outside what it seals (signature.py)
UNSEALED_FILES = (MANIFEST, SIGNATURES)  # the bundle's files its file list leaves out
SEAL_ALGORITHM = "sha256-canonical-json"
UNSEALED = ("bundle_id", "seal")
# Keys whose string values are paths inside the bundle (files or folders).
PATH_KEYS = frozenset({"artifact", "compile_script", "inputs", "qpc", "log", "qpc_files"})
_SHA256 = re.compile(r"[0-9a-f]{64}")
# A manifest lists every file of a bundle in about 150 bytes each; 64 MiB is far beyond any.
MAX_MANIFEST_BYTES = 64 << 20


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


def write_manifest(folder: Path, manifest: "Manifest") -> "Manifest":
    """Seal and write atomically; returns the sealed manifest."""
    sealed = seal(manifest.to_json_dict())
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(sealed, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(folder / MANIFEST)
    return Manifest.check(sealed, str(folder / MANIFEST))


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


def check_file_list(files: dict[str, Any], source: str) -> None:
    """One name per file: each path canonical (no '.', empty or trailing parts, so `a//b` and
    `./a` cannot stand beside `a/b` and `a`), none both a file and a folder, and neither of the
    unsealed files (manifest.json, signatures.json) among the sealed ones."""
    for path in files:
        check_relative(path, f"files.{path}")
        if PurePosixPath(path).as_posix() != path or "." in path.split("/"):
            raise BundleError(f"{source}: manifest field files: '{path}' is not written in "
                              f"canonical form ('{PurePosixPath(path).as_posix()}'); a bundle "
                              "names each file one way")
        if path in UNSEALED_FILES:
            raise BundleError(f"{source}: manifest field files: '{path}' is never sealed; a "
                              "manifest that lists it was not written by qpcbuild")
    for path in files:
        parent = PurePosixPath(path).parent
        while parent.parts:
            if parent.as_posix() in files:
                raise BundleError(f"{source}: manifest field files: '{parent.as_posix()}' is "
                                  f"listed as a file and as the folder of '{path}'")
            parent = parent.parent


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
    check_file_list(m["files"], source)
    for path, meta in m["files"].items():
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


def _read_json(bundle: Path) -> dict[str, Any]:
    """The manifest of a bundle folder as JSON, structurally checked (not its values)."""
    bundle = Path(bundle)
    path = bundle / MANIFEST
    # A wrong argument is bad input (exit 2); a damaged bundle is a bundle failure (exit 1).
    if not bundle.is_dir():
        raise UsageError(f"{bundle}: " + ("not a folder (a bundle is the folder `qpcbuild "
                                          "compile` writes; use `qpcbuild unpack` for a .tar.gz)"
                                          if bundle.exists() else "no such bundle folder"))
    if not path.is_file():
        raise UsageError(f"{bundle}: no {MANIFEST}; not a qpcbuild bundle")
    manifest = _parse(read_small_file(path, MAX_MANIFEST_BYTES, BundleError), str(path))
    schema = manifest.get("schema") if isinstance(manifest, dict) else None
    if isinstance(schema, int) and not isinstance(schema, bool) and 0 < schema < MANIFEST_SCHEMA:
        # An older qpcbuild's bundle: a usage problem (which qpcbuild reads it), not damage.
        raise UsageError(f"{path}: manifest schema {schema} was written by an older qpcbuild; "
                         f"this one reads schema {MANIFEST_SCHEMA} only (schema 3 records the "
                         "compiled Ks and shapes once): rebuild the bundle from its recipe.yaml "
                         "with this qpcbuild")
    if schema != MANIFEST_SCHEMA:
        raise BundleError(f"{path}: manifest schema {schema!r} is not supported (this qpcbuild "
                          f"reads schema {MANIFEST_SCHEMA})")
    check_structure(manifest, str(path))
    checked: dict[str, Any] = manifest  # (a mapping: check_structure says so)
    return checked


def _parse(raw: bytes, source: str) -> Any:
    # ValueError covers a number longer than Python's int-string limit (4,300 digits)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise BundleError(f"{source}: corrupted manifest ({str(exc)[:200]})") from None


class SealedManifest:
    """A bundle's manifest as read, before its values are trusted: verification compares the
    seal and the file list first, so that an edit that was not re-sealed is named by the field
    it changed; `checked()` then gives the typed Manifest."""

    def __init__(self, bundle: Path):
        self.bundle = Path(bundle)
        self._raw = _read_json(self.bundle)

    @property
    def bundle_id(self) -> Any:
        return self._raw.get("bundle_id")

    @property
    def files(self) -> dict[str, Any]:
        files: dict[str, Any] = self._raw["files"]
        return files

    def changed_fields(self) -> list[str]:
        return changed_fields(self._raw)

    def checked(self) -> Manifest:
        return Manifest.check(self._raw, str(self.bundle / MANIFEST))


def read_manifest(bundle: Path) -> Manifest:
    """The typed manifest of a bundle folder, its structure and values checked."""
    return SealedManifest(bundle).checked()


def manifest_from_json(raw: bytes, source: str) -> Manifest:
    """A manifest held as bytes (a registry's config blob), checked like one read from disk."""
    data = _parse(raw, source)
    check_structure(data, source)
    return Manifest.check(data, source)

"""Who built a bundle: Ed25519 signatures over its bundle id.

The seal (manifest.py) is an unkeyed digest: it says a bundle is intact, not who made it, since
anyone who can write a bundle can re-seal it. A signature binds the bundle id, which covers every
byte of the bundle, to a key. Signatures live in `signatures.json` beside `manifest.json`, outside
the sealed file list (a signature cannot be part of what it signs), so signing never changes the
bundle id and several keys may sign one bundle. The file is self-contained JSON, the form an OCI
registry keeps next to an artifact as a referrer (see docs/signing.md).

Keys are PEM files as `openssl genpkey -algorithm ed25519` or `qpcbuild keygen` write them. An
encrypted private key takes its passphrase from $QPCBUILD_SIGNING_KEY_PASSPHRASE, never from the
command line.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BundleError, UsageError
from ..smallfile import read_small_file
from .manifest import SIGNATURES

if TYPE_CHECKING:  # (cryptography is imported where a key is used: start-up stays quick)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
ALGORITHM = "ed25519"
# A PEM Ed25519 key is under 200 bytes, an encrypted one under 400; a signatures.json holds
# about 250 bytes per signature.
MAX_KEY_BYTES = 64 << 10
MAX_SIGNATURES_BYTES = 4 << 20
PASSPHRASE_ENV = "QPCBUILD_SIGNING_KEY_PASSPHRASE"
# Domain separation: a signature over a bundle id cannot be replayed as one over anything else.
_CONTEXT = b"qpcbuild bundle id v1\n"


def _message(bundle_id: str) -> bytes:
    return _CONTEXT + bundle_id.encode("ascii")


def _public_bytes(public_key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key: Ed25519PublicKey) -> str:
    """A key's name in signatures.json: SHA-256 of its raw 32 bytes, as `sha256:` hex."""
    return "sha256:" + hashlib.sha256(_public_bytes(public_key)).hexdigest()


def _read_key(path: Path, private: bool) -> object:
    """The key in a PEM file (a bad file: UsageError, exit 2); _ed25519 checks its kind."""
    from cryptography.hazmat.primitives import serialization

    kind = "private" if private else "public"
    key: object
    data = read_small_file(Path(path), MAX_KEY_BYTES, UsageError, f"--key {path}")
    try:
        if private:
            secret = os.environ.get(PASSPHRASE_ENV)
            key = serialization.load_pem_private_key(
                data, secret.encode() if secret else None)
        else:
            key = serialization.load_pem_public_key(data)
    except TypeError:  # encrypted without a passphrase, or a passphrase for a plain key
        raise UsageError(f"--key {path}: the key is encrypted; set {PASSPHRASE_ENV}") from None
    except ValueError as exc:
        raise UsageError(f"--key {path}: not a PEM {kind} key ({exc})") from None
    return key


def _not_ed25519(path: Path, kind: str, key: object) -> UsageError:
    return UsageError(f"--key {path}: an Ed25519 {kind} key is needed, this is a "
                      f"{type(key).__name__}")


def generate_key(path: Path) -> tuple[Path, str]:
    """A new Ed25519 key pair: PATH (private, mode 0600) and PATH.pub. Returns (.pub, key id)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    path, pub = Path(path), Path(f"{path}.pub")
    for p in (path, pub):
        if p.exists():
            raise UsageError(f"{p} exists; not overwriting a key")
    # `keygen keys/release` on a fresh clone: the folder is made (private, like ~/.ssh); a
    # parent that cannot be made (a file in the way, no permission) is named, not a traceback.
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{path.parent}: cannot make the key's folder "
                         f"({exc.strerror or exc})") from None
    key = ed25519.Ed25519PrivateKey.generate()
    made = False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        made = True
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
        pub.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    except OSError as exc:
        if made:
            path.unlink(missing_ok=True)  # never half a pair
        raise UsageError(f"{exc.filename or path}: cannot write the key "
                         f"({exc.strerror or exc})") from None
    return pub, key_id(key.public_key())


def read_signatures(bundle: Path) -> list[dict[str, Any]]:
    """The signature entries of a bundle; [] when it has none. A damaged file is an error."""
    path = Path(bundle) / SIGNATURES
    if not path.exists() and not path.is_symlink():
        return []
    raw = read_small_file(path, MAX_SIGNATURES_BYTES, BundleError, follow_links=False)
    return parse_signatures(raw, str(path))


def parse_signatures(text: str | bytes, where: str) -> list[dict[str, Any]]:
    """The entries of a signatures.json document (a file, or a registry referrer's layer)."""
    try:
        entries = json.loads(text)["signatures"]
        if not (isinstance(entries, list) and all(isinstance(e, dict) for e in entries)):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise BundleError(f"{where}: not a readable signature file") from None
    unknown = [e.get("algorithm") for e in entries if e.get("algorithm") != ALGORITHM]
    if unknown:
        # Refused rather than skipped: a signature this qpcbuild cannot check must not be
        # mistaken for one it did.
        raise BundleError(f"{where}: signature algorithm {str(unknown[0])[:40]!r} is not "
                          f"supported (this qpcbuild checks {ALGORITHM} only)")
    return entries


def write_signatures(bundle: Path, entries: list[dict[str, Any]]) -> None:
    tmp = Path(bundle) / f".{SIGNATURES}.tmp"
    tmp.write_text(json.dumps({"signatures": entries}, indent=1) + "\n", encoding="utf-8")
    tmp.replace(Path(bundle) / SIGNATURES)


def read_public_key(path: Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (a bad file is a usage error, exit 2)."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = _read_key(path, private=False)
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise _not_ed25519(path, "public", key)
    return key


def sign_bundle(bundle: Path, key_path: Path) -> dict[str, Any]:
    """Sign a bundle that verifies; replaces an earlier signature by the same key. Returns the
    new entry."""
    from .manifest import read_manifest
    from .verify import verify_bundle

    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = _read_key(key_path, private=True)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise _not_ed25519(key_path, "private", key)
    problems = verify_bundle(bundle)
    if problems:
        raise BundleError(f"{bundle} does not match its manifest, so it is not signed: "
                          + "; ".join(problems[:3]))
    bundle_id = read_manifest(bundle).bundle_id
    if bundle_id is None:  # (a bundle that verifies is sealed)
        raise BundleError(f"{bundle}: the manifest is not sealed, so it is not signed")
    kid = key_id(key.public_key())
    entry = {"algorithm": ALGORITHM, "key_id": kid, "bundle_id": bundle_id,
             "signature": base64.b64encode(key.sign(_message(bundle_id))).decode("ascii")}
    others = [e for e in read_signatures(bundle) if e.get("key_id") != kid]
    write_signatures(bundle, others + [entry])
    return entry


def check_signature(bundle: Path, bundle_id: str, public_key_path: Path,
                    where: str | None = None) -> str:
    """Raise BundleError unless the bundle carries a valid signature of `bundle_id` by the key.
    The caller must have verified the bundle (its files and seal give that id). `where` names
    the bundle in messages (default: its folder). Returns the key id."""
    from cryptography.exceptions import InvalidSignature

    key = read_public_key(public_key_path)
    where = where or str(bundle)
    kid = key_id(key)
    entries = read_signatures(bundle)
    mine = [e for e in entries if e.get("key_id") == kid]
    if not mine:
        raise BundleError(f"{where}: no signature by the key {public_key_path} ({kid[:19]}…); "
                          f"{len(entries)} other signature(s)")
    for entry in mine:
        try:
            raw = base64.b64decode(str(entry.get("signature")), validate=True)
            key.verify(raw, _message(bundle_id))
            return kid
        except (InvalidSignature, ValueError):
            continue
    raise BundleError(f"{where}: the signature by {public_key_path} does not match this bundle "
                      f"(id {bundle_id[:16]}…): forged, or made for another build")

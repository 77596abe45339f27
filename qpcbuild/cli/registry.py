"""Commands that move bundles through an OCI registry: push, pull."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .app import app, emit_json, handles_errors, progress_line
from .refs import InsecureOpt
from .render import console
from .run import RequireSignatureOpt


@app.command()
@handles_errors
def push(bundle: Path = typer.Argument(..., help="Bundle folder."),
         ref: str = typer.Argument(..., help="REGISTRY/REPOSITORY:TAG, e.g. "
                                   "localhost:5000/team/demo:v1."),
         insecure: bool = InsecureOpt,
         quiet: bool = typer.Option(False, "-q", "--quiet", help="Print only the digest."),
         json_out: bool = typer.Option(False, "--json", help="One JSON result.")):
    """Verify a bundle and upload it as an OCI artifact (one layer per file); print the
    manifest digest to pin. Credentials: Docker's config file or QPCBUILD_REGISTRY_USERNAME /
    QPCBUILD_REGISTRY_PASSWORD."""
    from ..registry.bundles import push_bundle
    from ..registry.client import RegistryClient
    from ..registry.reference import parse_reference

    reference = parse_reference(ref, "REF")
    say = None if quiet or json_out else progress_line
    with RegistryClient(reference.registry, insecure) as client:
        result, signatures = push_bundle(bundle, reference, client, say)
    pinned = f"{reference.registry}/{reference.repository}@{result.digest}"
    if json_out:
        emit_json({"reference": str(reference), "pinned": pinned, **result.to_dict(),
                   "signatures_attached": signatures})
    elif quiet:
        print(result.digest)
    else:
        console.print(f"pushed {reference} ({result.files} files, {result.bytes:,} bytes, "
                      f"{result.sent:,} uploaded)"
                      + (f"; {signatures} signature(s) attached as a referrer"
                         if signatures else ""))
        print(result.digest)


@app.command()
@handles_errors
def pull(ref: str = typer.Argument(..., help="REGISTRY/REPOSITORY:TAG or "
                                   "REGISTRY/REPOSITORY@sha256:DIGEST."),
         dest: Optional[Path] = typer.Option(None, "-d", "--dest", help="The bundle folder to "
                                             "create (a bundle there is replaced; default: "
                                             "./REPOSITORY's last part)."),
         insecure: bool = InsecureOpt,
         require_signature: Optional[Path] = RequireSignatureOpt,
         json_out: bool = typer.Option(False, "--json", help="One JSON result.")):
    """Download a bundle, check every layer's digest and the bundle id, and rename it into
    place: a failed or interrupted pull leaves nothing. Signatures attached to it in the
    registry come back as its signatures.json."""
    from ..registry.bundles import pull_bundle
    from ..registry.client import RegistryClient
    from ..registry.reference import parse_reference

    reference = parse_reference(ref, "REF")
    out = dest or Path(reference.repository.rsplit("/", 1)[-1])
    with RegistryClient(reference.registry, insecure) as client:
        got = pull_bundle(reference, out, client, None if json_out else progress_line,
                          signed_by=require_signature)
    if json_out:
        emit_json({"reference": str(reference), "bundle": str(out), "bundle_id": got.bundle_id,
                   "digest": got.digest, "signatures": got.signatures,
                   "signed_by": str(require_signature) if require_signature else None,
                   "up_to_date": got.up_to_date, "downloaded_bytes": got.downloaded})
    else:
        done = f"{out} is up to date with {reference}" if got.up_to_date else \
            f"pulled {reference} into {out}"
        console.print(f"{done}: bundle id {got.bundle_id} ({got.digest})"
                      + ("" if got.up_to_date else f", {got.downloaded:,} bytes downloaded")
                      + (f", {got.signatures} signature(s)" if got.signatures else "")
                      + (f", signed by {require_signature}" if require_signature else ""))

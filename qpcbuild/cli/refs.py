"""What commands that take a BUNDLE share so that BUNDLE may be a registry reference."""

from __future__ import annotations

from pathlib import Path

import typer

from .app import progress_line

BUNDLE_HELP = "Bundle folder, or a registry reference (REGISTRY/REPO:TAG or @sha256:...) " \
    "pulled into the local store ($QPCBUILD_STORE) unless it is there already."
InsecureOpt = typer.Option(False, "--insecure", envvar="QPCBUILD_REGISTRY_INSECURE",
                           help="Plain HTTP to a registry that is not on this machine "
                           "(loopback registries always use plain HTTP).")


def bundle_folder(arg: Path, insecure: bool, quiet: bool = False,
                  signatures: bool = False) -> Path:
    """`signatures`: a signature will be checked, so a stored copy gets the registry's newest."""
    from ..registry.bundles import open_bundle

    return open_bundle(arg, insecure, None if quiet else progress_line, signatures)

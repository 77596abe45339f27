"""Commands on a built bundle (verify, finish, inspect, doctor, package, unpack) and the build
cache."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .app import app, emit_json, handles_errors
from .refs import BUNDLE_HELP, InsecureOpt, bundle_folder
from .render import console, err_console


@app.command()
@handles_errors
def verify(bundle: Path = typer.Argument(..., help=BUNDLE_HELP),
           insecure: bool = InsecureOpt,
           fast: bool = typer.Option(False, "--fast", help="Check presence and sizes only "
                                     "(for huge QPCs); skips SHA-256 and the seal."),
           key: Optional[Path] = typer.Option(None, "--key", help="Also require a valid "
                                              "signature by this Ed25519 public key (PEM)."),
           json_out: bool = typer.Option(False, "--json", help="One JSON result (for CI).")):
    """Recompute the bundle id and every file digest. Exit 1 naming each changed field or file."""
    from ..bundle import read_manifest, verify_bundle
    from ..bundle.signature import check_signature
    from ..errors import BundleError, UsageError

    if key is not None and fast:
        raise UsageError("--key needs the full check: a signature vouches for the bundle id, "
                         "which --fast does not recompute")
    bundle = bundle_folder(bundle, insecure, quiet=json_out, signatures=key is not None)
    problems, bundle_id = [], None
    try:
        problems = verify_bundle(bundle, fast=fast)
        bundle_id = read_manifest(bundle).bundle_id
        if key is not None and not problems:
            check_signature(bundle, bundle_id, key)
    except BundleError as exc:
        problems.append(str(exc))
    if json_out:
        emit_json({"bundle": str(bundle), "bundle_id": bundle_id, "ok": not problems,
                   "checked": "sizes" if fast else "seal and sha256", "problems": problems})
    else:
        for p in problems:
            err_console.print(f"[red]✗[/] {p}", soft_wrap=True)
        if not problems:
            console.print(f"[green]✓[/] {bundle}: bundle id {bundle_id} "
                          + ("(sizes only)" if fast else "matches its content and every file")
                          + (f", signed by {key}" if key else ""))
    if problems:
        raise typer.Exit(1)


@app.command()
@handles_errors
def sign(bundle: Path = typer.Argument(..., help="Bundle folder."),
         key: Path = typer.Option(..., "--key", help="Ed25519 private key (PEM; an encrypted one "
                                  "reads its passphrase from $QPCBUILD_SIGNING_KEY_PASSPHRASE).")):
    """Sign the bundle id with your key (signatures.json beside the manifest; the id is
    unchanged). The bundle must verify first."""
    from ..bundle.signature import SIGNATURES, sign_bundle

    entry = sign_bundle(bundle, key)
    console.print(f"[green]✓[/] {bundle}: bundle id {entry['bundle_id']} signed by "
                  f"{entry['key_id']} ({SIGNATURES})")


@app.command()
@handles_errors
def keygen(path: Path = typer.Argument(..., help="Private key file to write; the public key "
                                       "goes to PATH.pub.")):
    """Make an Ed25519 key pair for `qpcbuild sign` (private key mode 0600, unencrypted)."""
    from ..bundle.signature import generate_key

    pub, kid = generate_key(path)
    console.print(f"[green]✓[/] wrote {path} (keep it private) and {pub} (share it); key {kid}")


@app.command()
@handles_errors
def finish(bundle: Path = typer.Argument(..., help="Bundle folder built with --emit-only."),
           role: Optional[List[str]] = typer.Option(None, "--role", help="target | draft "
                                                    "(repeatable; default: every qaic role)."),
           compiler: Optional[str] = typer.Option(None, help="The qaic-compile that built the "
                                                  "QPCs (recorded by name and digest).")):
    """Adopt QPCs compiled by <role>/qaic/compile.sh into the bundle and re-seal its manifest."""
    from ..backends.qaic.finish import finish_bundle
    from ..backends.qaic.manifest import QaicEntry

    m = finish_bundle(bundle, list(role or []) or None, compiler)
    for name, info in m.roles.items():
        q = info.built(QaicEntry)
        if q:
            console.print(f"{name}: {q.status}" + (f", {len(q.qpc_files or [])} QPC files in "
                                                   f"{q.qpc}" if q.qpc else ""))
    console.print(f"[green]✓[/] {bundle}: new bundle id {m.bundle_id}")


@app.command()
@handles_errors
def inspect(bundle: Path = typer.Argument(..., help=BUNDLE_HELP),
            insecure: bool = InsecureOpt,
            json_out: bool = typer.Option(False, "--json", help="Print the manifest.")):
    """Summarize a bundle: roles, shapes, Ks, cores, backends, files."""
    from ..bundle import read_manifest
    from .render import show_manifest

    m = read_manifest(bundle_folder(bundle, insecure, quiet=json_out))
    emit_json(m.to_json_dict()) if json_out else show_manifest(m)


@app.command()
@handles_errors
def doctor(bundle: Path = typer.Argument(..., help="Bundle folder, or one .onnx file."),
           json_out: bool = typer.Option(False, "--json", help="The report as JSON.")):
    """Compare each role's card graph (or one ONNX file) with QEfficient's own exports: ops and
    their attributes, function bodies and call sites. Flag each departure; exit 1 if any."""
    from ..bundle import read_manifest
    from ..bundle.doctor import doctor as run_doctor

    loose = bundle.suffix == ".onnx" and not bundle.is_dir()
    report = run_doctor(bundle, None if loose else read_manifest(bundle))
    if json_out:
        emit_json(report)
    else:
        for role, r in report["roles"].items():
            if r["graph"] is None:
                console.print(f"{role}: {r['note']}")
                continue
            console.print(f"{role}: {r['graph']}", markup=False)
            console.print("  opsets: " + ", ".join(f"{d} {v}" for d, v in r["opsets"].items()))
            for name, f in r["functions"].items():
                console.print(f"  function {f['domain']}::{name}({', '.join(f['inputs'])})"
                              + (f" [{', '.join(f['attributes'])}]" if f["attributes"] else ""),
                              markup=False)
            console.print("  ops: " + ", ".join(f"{op} x{n}" for op, n in r["ops"].items()),
                          markup=False, soft_wrap=True)
            if r.get("note"):
                console.print(f"  NOTE {r['note']}", markup=False, soft_wrap=True)
            for finding in r["findings"]:
                console.print(f"  FLAG {finding}", markup=False)
        if not report["checked"]:
            console.print("nothing to check: this bundle holds no card graph")
        else:
            console.print("card graphs speak QEfficient's vocabulary" if report["clean"] else
                          "some card graph uses what QEfficient does not emit (FLAG lines)")
    if not report["clean"]:
        raise typer.Exit(1)


@app.command()
@handles_errors
def package(bundle: Path = typer.Argument(..., help="Bundle folder."),
            out: Path = typer.Option(..., "-o", "--out", help="Archive path: .tar.gz, or .tar "
                                     "for no compression (as fast as the disk).")):
    """Deterministic .tar.gz or .tar of a bundle (sorted entries, fixed mtimes and owners),
    its top folder named after the bundle (the recipe's name), whatever the local folder."""
    from ..bundle.archive import pack
    from ..bundle import read_manifest

    pack(bundle, out, top=read_manifest(bundle).name)
    console.print(f"wrote {out} ({out.stat().st_size:,} bytes)")


@app.command()
@handles_errors
def unpack(archive: Path = typer.Argument(..., help="A .tar.gz or .tar made by `qpcbuild "
                                          "package`."),
           dest: Path = typer.Option(Path("."), "-d", "--dest", help="Folder to unpack into: "
                                     "the bundle's own folder is created there.")):
    """Safely unpack a bundle archive into a folder named after the bundle inside DEST
    (refuses absolute paths, '..', links and devices, and a bundle folder that exists)."""
    from ..bundle.archive import unpack as unpack_archive

    path = unpack_archive(archive, dest)
    if dest.is_symlink():  # say where the files went, not only the link's name
        console.print(f"-d {dest} is a symbolic link to {path.parent}; the bundle is there")
    console.print(f"unpacked {path}; check it with `qpcbuild verify {path}`")


# ---------------------------------------------------------------- the build cache
cache_app = typer.Typer(no_args_is_help=True, help="List, check and clean the build cache.")
app.add_typer(cache_app, name="cache")
CacheDirOpt = typer.Option(None, "--cache-dir", help="Build cache (default: the user cache "
                           "dir, or $QPCBUILD_CACHE).")


def _existing_cache(cache_dir: Optional[Path]):
    """The cache to list, check or clean: a --cache-dir that does not exist is a typo, not an
    empty cache."""
    from ..cache import Cache
    from ..errors import UsageError

    if cache_dir is not None and not cache_dir.is_dir():
        raise UsageError(f"--cache-dir {cache_dir}: " + ("not a folder" if cache_dir.exists()
                                                          else "no such folder"))
    return Cache(cache_dir)


@cache_app.command("ls")
@handles_errors
def cache_ls(cache_dir: Optional[Path] = CacheDirOpt,
             json_out: bool = typer.Option(False, "--json", help="One JSON list.")):
    """Entries with their size and last use."""
    from rich.table import Table

    cache = _existing_cache(cache_dir)
    entries, others = cache.entries(), cache.other_items()
    if json_out:
        emit_json([e.to_dict() for e in entries]
                  + [{"kind": "other", "key": name, "bytes": size} for name, size in others])
        return
    t = Table("kind", "key", "MiB", "last used (UTC)", title=str(cache.root),
              title_justify="left")
    for e in entries:
        t.add_row(e.kind, e.key, f"{e.bytes / 2**20:.1f}", e.to_dict()["last_used"])
    for name, size in others:
        t.add_row("other", name, f"{size / 2**20:.1f}", "")
    console.print(t)
    total = sum(e.bytes for e in entries) + sum(size for _, size in others)
    console.print(f"{len(entries)} entries; {total / 2**20:.1f} MiB in all under {cache.root}")


@cache_app.command("verify")
@handles_errors
def cache_verify(cache_dir: Optional[Path] = CacheDirOpt,
                 json_out: bool = typer.Option(False, "--json", help="One JSON list.")):
    """Recompute every entry's file digests against its record. Exit 1 if any entry changed."""
    entries = _existing_cache(cache_dir).entries(check=True)
    if json_out:
        emit_json([e.to_dict() for e in entries])
    else:
        for e in entries:
            mark = "[green]✓[/]" if not e.problems else "[red]✗[/]"
            console.print(f"{mark} {e.kind}/{e.key}" + (": " + "; ".join(e.problems)
                                                       if e.problems else ""))
        console.print(f"{len(entries)} entries, {sum(bool(e.problems) for e in entries)} damaged"
                      + ("; `qpcbuild cache prune` removes them" if any(e.problems for e in
                                                                        entries) else ""))
    if any(e.problems for e in entries):
        raise typer.Exit(1)


@cache_app.command("prune")
@handles_errors
def cache_prune(cache_dir: Optional[Path] = CacheDirOpt,
                days: Optional[float] = typer.Option(None, "--days", min=0, help="Also remove "
                                                     "entries not used for this many days.")):
    """Remove debris of killed builds, damaged entries and (with --days) unused ones."""
    removed = _existing_cache(cache_dir).prune(days)
    for r in removed:
        console.print(f"removed {r}")
    console.print(f"{len(removed)} removed")

"""The `qpcbuild` command line: parse, call one stage, render. No logic lives here.

One file for every command on purpose (~570 lines, almost all option declarations): the
commands read in the order `qpcbuild --help` lists them, and each body is a few lines.

Exit codes: 0 success; 1 build, toolchain or bundle failure; 2 bad input (recipe, model folder,
bundle path, CLI argument).
"""

from __future__ import annotations

import functools
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, List, Optional

import typer

from .errors import QpcbuildError, Terminated
from .render import console, err_console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build and package speculative-decoding model pairs for Qualcomm Cloud AI "
                       "100 (qaic) and ONNX Runtime, and run them.")

RecipeArg = typer.Argument(..., help="Recipe YAML file (see recipes/).", show_default=False)
SetOpt = typer.Option(None, "--set", help="Override a recipe key: --set shapes.ctx_len=4096 "
                      "(repeatable).")


def _terminate(signum, frame):
    raise Terminated()


def handles_errors(fn: Callable) -> Callable:
    """Users get a message and an exit code, never a stack trace. SIGTERM unwinds like Ctrl-C,
    so a killed build removes its staging folder and temp cache entries."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _terminate) if main else None
        try:
            return fn(*args, **kwargs)
        except QpcbuildError as exc:
            err_console.print(f"[red]error:[/] {exc}", soft_wrap=True)
            if kwargs.get("json_out") is True or kwargs.get("json_stdout") is True:
                emit_json({"error": error_object(exc)})  # CI parses stdout
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[red]interrupted[/]")
            raise typer.Exit(130) from None
        except Terminated:
            err_console.print("[red]terminated[/]")
            raise typer.Exit(143) from None
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
    return wrapper


def error_object(exc: QpcbuildError) -> dict:
    """What `--json` prints on failure: the exit code, the message and, for a recipe, where."""
    from .errors import RecipeError

    where = [{"path": p.path, "line": p.line, "message": p.message}
             for p in exc.problems] if isinstance(exc, RecipeError) else None
    return {"code": exc.exit_code, "type": type(exc).__name__, "message": str(exc),
            "where": where}


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")


@app.command()
@handles_errors
def plan(recipe: Path = RecipeArg, set_: Optional[List[str]] = SetOpt,
         json_out: bool = typer.Option(False, "--json", help="One JSON document (for CI)."),
         resolved: bool = typer.Option(False, "--resolved",
                                       help="Print the resolved recipe (defaults filled in).")):
    """Validate a recipe and show exactly what `compile` will build. Reads configs, never weights."""
    from .plan import make_plan
    from .recipe import load_recipe
    from .render import show_plan
    import yaml

    r = load_recipe(recipe, set_ or [])
    if resolved:
        sys.stdout.write(yaml.safe_dump(r.to_yaml_dict(), sort_keys=False))
        return
    p = make_plan(r)
    if json_out:
        emit_json(p.to_dict())
    else:
        show_plan(p)


@app.command()
@handles_errors
def export(model: str = typer.Argument(..., help="Local model folder or Hugging Face id "
                                       "(resolved from the local HF cache)."),
           role: str = typer.Option(..., "--role", help="target | draft"),
           out: Path = typer.Option(..., "-o", "--out", help="Output folder."),
           revision: Optional[str] = typer.Option(None, help="Hugging Face revision."),
           continuous_batching: bool = typer.Option(False, help="Add the batch_index input."),
           weight_dtype: str = typer.Option("float32", help="float32 | float16 stored weights."),
           check: bool = typer.Option(True, help="Run onnx.checker (full check) on the result."),
           allow_pickle: bool = typer.Option(False, help="Accept .bin/.pt checkpoints (they can "
                                             "run code when loaded; read weights-only)."),
           allow_unused_weights: bool = typer.Option(False, help="Export even when the "
                                                     "checkpoint holds tensors config.json does "
                                                     "not describe.")):
    """Export one checkpoint to the Cloud AI-compatible ONNX graph (retained-state KV)."""
    import time

    from .export import export_model
    from .errors import UsageError
    from .source import resolve

    if role not in ("target", "draft"):
        raise UsageError(f"--role must be target or draft, not '{role}'")
    if weight_dtype not in ("float32", "float16"):
        raise UsageError(f"--weight-dtype must be float32 or float16, not '{weight_dtype}'")
    start = time.perf_counter()
    res = export_model(resolve(model, revision, allow_known=False), role, out,
                       continuous_batching=continuous_batching, weight_dtype=weight_dtype,
                       allow_pickle=allow_pickle, allow_unused=allow_unused_weights)
    if check:
        import onnx
        onnx.checker.check_model(str(res.onnx_path), full_check=True)
    console.print(f"exported {res.arch.architecture} ({res.arch.param_count:,} parameters) as "
                  f"{role} to {res.onnx_path} in {time.perf_counter() - start:.1f} s; weights "
                  f"digest {res.weights_digest[:16]}")


@app.command()
def version():
    """Print versions of qpcbuild and its toolchain."""
    from .toolchain import versions
    emit_json(versions())


def main() -> None:  # pragma: no cover
    app()


# ---------------------------------------------------------------- build and bundles
@app.command()
@handles_errors
def compile(recipe: Path = RecipeArg, set_: Optional[List[str]] = SetOpt,
            out: Optional[Path] = typer.Option(None, "-o", "--out",
                                               help="Bundle folder (default: the recipe's output)."),
            emit_only: bool = typer.Option(False, "--emit-only", help="qaic: write graphs, "
                                           "compiler inputs and compile.sh; do not compile."),
            compiler: Optional[str] = typer.Option(None, help="Path to qaic-compile/qaic-exec."),
            cache_dir: Optional[Path] = typer.Option(None, help="Build cache (default: the user "
                                                     "cache dir, or $QPCBUILD_CACHE)."),
            jobs: int = typer.Option(2, min=1, help="Export target and draft concurrently."),
            smoke_weights: bool = typer.Option(False, "--smoke-weights", help="Use random weights "
                                               "of the recipe's exact shapes (for checking a "
                                               "recipe without the real checkpoint)."),
            smoke_layers: Optional[int] = typer.Option(2, min=1, help="With --smoke-weights: "
                                                       "layers per model (0 = all)."),
            tune_k: bool = typer.Option(False, "--tune", help="Pick K first from measured "
                                        "acceptance and costs (`qpcbuild tune` with its "
                                        "defaults) and record the evidence."),
            json_out: bool = typer.Option(False, "--json", help="One JSON result at the end.")):
    """Build the bundle: export both models, compile for each backend, write the manifest."""
    import time

    from .bundle import build_bundle
    from .cache import Cache
    from .plan import make_plan
    from .recipe import load_recipe

    tuning = None
    if tune_k:
        from .errors import UsageError
        from .tune import show_tune, tune as run_tune

        if smoke_weights:
            raise UsageError("--tune measures the real models; it cannot be combined with "
                             "--smoke-weights")
        tuning = run_tune(recipe, set_ or [], cache_dir=cache_dir, say=_progress_line)
        if not json_out:
            show_tune(tuning)
        set_ = [*(set_ or []), f"speculation.num_speculative_tokens={tuning['chosen_k']}"]
    r = load_recipe(recipe, set_ or [])
    cache = Cache(cache_dir, say=lambda m: err_console.print(f"[yellow]warning:[/] {m}"))
    if smoke_weights:
        from .smoke import with_smoke_weights
        r = with_smoke_weights(r, cache.root / "smoke", smoke_layers or None,
                               say=lambda m: err_console.print(m))
    plan_ = make_plan(r, compiler)
    started = time.perf_counter()

    def progress(stage: str, how: str, seconds: float) -> None:
        if not json_out:
            mark = "[green]✓[/]" if how == "built" else "[cyan]↺[/]"
            console.print(f"{mark} {stage:<28} {how:<7} {seconds:6.1f} s   "
                          f"(elapsed {time.perf_counter() - started:.1f} s)")

    for w in plan_.warnings:
        err_console.print(f"[yellow]warning:[/] {w}")
    result = build_bundle(plan_, cache=cache, out=out, emit_only=emit_only, compiler=compiler,
                          jobs=jobs, progress=progress,
                          manifest_extra={"tuning": tuning} if tuning else None)
    if json_out:
        emit_json({**result.to_dict(), **({"tuning": {
            "chosen_k": tuning["chosen_k"], "recommended_ks": tuning["recommended_ks"],
            "file": tuning.get("file", "manifest.json")}} if tuning else {})})
    else:
        console.print(f"bundle [bold]{result.bundle}[/] id {result.bundle_id[:16]} built in "
                      f"{result.seconds:.1f} s")
        if tuning is not None:
            console.print(f"K={tuning['chosen_k']} from tuning; evidence in "
                          f"{tuning.get('file', 'the manifest (key tuning)')}")


@app.command()
@handles_errors
def verify(bundle: Path = typer.Argument(..., help="Bundle folder."),
           fast: bool = typer.Option(False, "--fast", help="Check presence and sizes only "
                                     "(for huge QPCs); skips SHA-256 and the seal."),
           json_out: bool = typer.Option(False, "--json", help="One JSON result (for CI).")):
    """Recompute the bundle id and every file digest. Exit 1 naming each changed field or file."""
    from .bundle import read_manifest, verify_bundle
    from .errors import BundleError

    try:
        problems = verify_bundle(bundle, fast=fast)
        bundle_id = read_manifest(bundle)["bundle_id"]
    except BundleError as exc:
        problems, bundle_id = [str(exc)], None
    if json_out:
        emit_json({"bundle": str(bundle), "bundle_id": bundle_id, "ok": not problems,
                   "checked": "sizes" if fast else "seal and sha256", "problems": problems})
    else:
        for p in problems:
            err_console.print(f"[red]✗[/] {p}", soft_wrap=True)
        if not problems:
            console.print(f"[green]✓[/] {bundle}: bundle id {bundle_id} "
                          + ("(sizes only)" if fast else "matches its content and every file"))
    if problems:
        raise typer.Exit(1)


@app.command()
@handles_errors
def finish(bundle: Path = typer.Argument(..., help="Bundle folder built with --emit-only."),
           role: Optional[List[str]] = typer.Option(None, "--role", help="target | draft "
                                                    "(repeatable; default: every qaic role)."),
           compiler: Optional[str] = typer.Option(None, help="The qaic-compile that built the "
                                                  "QPCs (recorded by name and digest).")):
    """Adopt QPCs compiled by <role>/qaic/compile.sh into the bundle and re-seal its manifest."""
    from .bundle import finish_bundle

    m = finish_bundle(bundle, list(role or []) or None, compiler)
    for name, info in m["roles"].items():
        q = info["backends"].get("qaic")
        if q:
            console.print(f"{name}: {q['status']}" + (f", {len(q['qpc_files'])} QPC files in "
                                                      f"{q['qpc']}" if q.get("qpc") else ""))
    console.print(f"[green]✓[/] {bundle}: new bundle id {m['bundle_id']}")


@app.command()
@handles_errors
def inspect(bundle: Path = typer.Argument(..., help="Bundle folder."),
            json_out: bool = typer.Option(False, "--json", help="Print the manifest.")):
    """Summarize a bundle: roles, shapes, Ks, cores, backends, files."""
    from .bundle import read_manifest
    from .render import show_manifest

    m = read_manifest(bundle)
    emit_json(m) if json_out else show_manifest(m)


@app.command()
@handles_errors
def doctor(bundle: Path = typer.Argument(..., help="Bundle folder."),
           json_out: bool = typer.Option(False, "--json", help="The report as JSON.")):
    """List the ops, domains and functions of each role's card graph and flag what the Cloud AI
    compiler has not seen from QEfficient. Exit 1 when something is flagged."""
    from .bundle import read_manifest
    from .bundle.doctor import doctor as run_doctor

    report = run_doctor(bundle, read_manifest(bundle))
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
            for finding in r["findings"]:
                console.print(f"  FLAG {finding}", markup=False)
        console.print("card graphs speak QEfficient's vocabulary" if report["clean"] else
                      "some card graph uses what QEfficient does not emit (FLAG lines)")
    if not report["clean"]:
        raise typer.Exit(1)


@app.command()
@handles_errors
def package(bundle: Path = typer.Argument(..., help="Bundle folder."),
            out: Path = typer.Option(..., "-o", "--out", help="Archive path (.tar.gz).")):
    """Deterministic .tar.gz of a bundle (sorted entries, fixed mtimes and owners)."""
    from .bundle.archive import pack
    from .bundle import read_manifest

    read_manifest(bundle)
    pack(bundle, out)
    console.print(f"wrote {out} ({out.stat().st_size:,} bytes)")


@app.command()
@handles_errors
def unpack(archive: Path = typer.Argument(..., help="A .tar.gz made by `qpcbuild package`."),
           dest: Path = typer.Option(Path("."), "-d", "--dest", help="Folder to unpack into.")):
    """Safely unpack a bundle archive (refuses absolute paths, '..', links and devices)."""
    from .bundle.archive import unpack as unpack_archive

    path = unpack_archive(archive, dest)
    console.print(f"unpacked {path}; check it with `qpcbuild verify {path}`")


# ---------------------------------------------------------------- the build cache
cache_app = typer.Typer(no_args_is_help=True, help="List, check and clean the build cache.")
app.add_typer(cache_app, name="cache")
CacheDirOpt = typer.Option(None, "--cache-dir", help="Build cache (default: the user cache "
                           "dir, or $QPCBUILD_CACHE).")


@cache_app.command("ls")
@handles_errors
def cache_ls(cache_dir: Optional[Path] = CacheDirOpt,
             json_out: bool = typer.Option(False, "--json", help="One JSON list.")):
    """Entries with their size and last use."""
    from rich.table import Table

    from .cache import Cache

    entries = Cache(cache_dir).entries()
    if json_out:
        emit_json([e.to_dict() for e in entries])
        return
    t = Table("kind", "key", "MiB", "last used (UTC)", title=str(Cache(cache_dir).root),
              title_justify="left")
    for e in entries:
        t.add_row(e.kind, e.key, f"{e.bytes / 2**20:.1f}", e.to_dict()["last_used"])
    console.print(t)


@cache_app.command("verify")
@handles_errors
def cache_verify(cache_dir: Optional[Path] = CacheDirOpt,
                 json_out: bool = typer.Option(False, "--json", help="One JSON list.")):
    """Recompute every entry's file digests against its record. Exit 1 if any entry changed."""
    from .cache import Cache

    entries = Cache(cache_dir).entries(check=True)
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
    from .cache import Cache

    removed = Cache(cache_dir).prune(days)
    for r in removed:
        console.print(f"removed {r}")
    console.print(f"{len(removed)} removed")


# ---------------------------------------------------------------- runtime
def _read_prompts(prompt: Optional[List[str]], prompt_file: Optional[Path]) -> list[str]:
    from .errors import UsageError
    from .prompts import read_prompt_file

    prompts = list(prompt or []) + (read_prompt_file(prompt_file) if prompt_file else [])
    if not prompts:
        raise UsageError("give --prompt TEXT or --prompt-file FILE")
    for n, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {n} is empty")
    return prompts


@app.command()
@handles_errors
def run(bundle: Path = typer.Argument(..., help="Bundle folder."),
        prompt: Optional[List[str]] = typer.Option(None, "--prompt", help="Prompt text "
                                                   "(repeatable: one batch)."),
        prompt_file: Optional[Path] = typer.Option(None, help="One prompt per line ('\\n' for "
                                                   "newlines), or JSONL with a \"prompt\" key."),
        max_new_tokens: int = typer.Option(64, help="New tokens per prompt."),
        temperature: float = typer.Option(0.0, help="0 = greedy."),
        top_p: float = typer.Option(1.0), top_k: int = typer.Option(0),
        seed: Optional[int] = typer.Option(None),
        method: Optional[str] = typer.Option(None, help="draft_model | ngram | suffix "
                                             "(default: the bundle's)."),
        k: Optional[int] = typer.Option(None, "--k", help="One of the compiled Ks."),
        backend: str = typer.Option("onnxruntime", help="onnxruntime | qaic"),
        ctx_len: Optional[int] = typer.Option(None, help="Refuse a bundle not compiled for this "
                                              "ctx_len."),
        batch_size: Optional[int] = typer.Option(None, help="Refuse a bundle not compiled for "
                                                 "this batch size."),
        verify: str = typer.Option("full", help="full | fast (sizes only) | none"),
        stream: bool = typer.Option(False, help="Print tokens as they are accepted."),
        compare_baseline: bool = typer.Option(False, help="Also decode target-only and report "
                                              "the speedup and whether outputs match."),
        chat: bool = typer.Option(False, help="Each prompt is a user message put through the "
                                  "bundle's chat template (as vLLM's chat endpoint does)."),
        system: Optional[str] = typer.Option(None, help="System message for --chat."),
        json_out: bool = typer.Option(False, "--json", help="Text, token ids and stats as JSON.")):
    """Run speculative decoding from a bundle (smoke test, with acceptance statistics)."""
    from .errors import UsageError
    from .render import show_run
    from .runtime.loader import load

    prompts = _read_prompts(prompt, prompt_file)
    if max_new_tokens <= 0:
        raise UsageError("--max-new-tokens must be at least 1")
    if system is not None and not chat:
        raise UsageError("--system needs --chat")
    gen = load(bundle, backend=backend, method=method, k=k, verify=verify, ctx_len=ctx_len,
               batch_size=batch_size)
    # Continuous batching takes every prompt at once and refills slots as requests finish.
    batch = len(prompts) if gen.decoder.cb else gen.target.batch_size
    on_token = None
    if stream and not json_out:
        on_token = lambda row, ids: console.print(  # noqa: E731
            gen.tokenizer.decode(ids), end="", soft_wrap=True, markup=False, highlight=False)
    results, baselines = [], []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        results.append(gen.generate(chunk, max_new_tokens, temperature, top_k, top_p, seed,
                                    on_token, chat=chat, system=system))
        if compare_baseline:
            baselines.append(gen.generate(chunk, max_new_tokens, temperature, top_k, top_p,
                                          seed, target_only=True, chat=chat, system=system))
    if stream and not json_out:
        console.print()
    report = {"bundle": str(bundle), "backend": backend, "method": gen.method,
              "batches": [r.to_dict() for r in results]}
    if backend == "onnxruntime":  # exact float32, or the card's formats emulated
        report["numerics"] = numerics_of(gen.manifest)
    if compare_baseline:
        spd = sum(r.stats["e2e_s"] for r in results)
        base = sum(b.stats["e2e_s"] for b in baselines)
        same = all(a.rows[i].tokens == b.rows[i].tokens for a, b in zip(results, baselines)
                   for i in range(len(a.rows)))
        report["baseline"] = {"batches": [b.to_dict() for b in baselines],
                              "speedup_e2e": round(base / max(spd, 1e-9), 3),
                              "outputs_match": same if temperature == 0 else None}
    if json_out:
        emit_json(report)
    else:
        show_run(report, show_text=not stream)


def numerics_of(manifest: dict) -> dict:
    """Per role: the onnxruntime artifact's numerics (exact | emulated) and formats."""
    out = {}
    for role, info in manifest["roles"].items():
        o = info["backends"].get("onnxruntime") or {}
        out[role] = {"numerics": o.get("numerics", "exact"),
                     **(o.get("numerics_formats") or {"weights": "float32", "kv": "float32"}),
                     "int8_weights": o.get("weights") == "int8"}
    return out


@app.command()
@handles_errors
def serve(bundle: Path = typer.Argument(..., help="Bundle folder."),
          host: str = typer.Option("127.0.0.1", help="Address to listen on."),
          port: int = typer.Option(8000, help="TCP port."),
          backend: str = typer.Option("onnxruntime", help="onnxruntime | qaic"),
          verify: str = typer.Option("full", help="full | fast (sizes only) | none"),
          served_model_name: Optional[str] = typer.Option(
              None, help="Model id clients ask for (default: the bundle's name)."),
          log_level: str = typer.Option("info", help="uvicorn log level.")):
    """OpenAI-compatible server on the bundle (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics with vLLM's metric names)."""
    from .errors import UsageError
    from .server import serve as run_server

    if not 0 < port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {port}")
    run_server(bundle, host, port, backend, verify, served_model_name, log_level)


@app.command("serve-config")
@handles_errors
def serve_config(bundle: Path = typer.Argument(..., help="Bundle folder."),
                 format: str = typer.Option("vllm", "--format", help="vllm | docker | env | "
                                            "legacy | json"),
                 image: str = typer.Option("ghcr.io/quic/cloud_ai_inference_vllm:latest",
                                           help="Cloud AI vLLM image for --format docker.")):
    """Emit the vLLM (Cloud AI) serve command, env vars or docker line for this bundle."""
    from .bundle import read_manifest
    from .serve_config import render

    sys.stdout.write(render(read_manifest(bundle), bundle, format, image))


# ---------------------------------------------------------------- measuring and tuning
def _progress_line(message: str) -> None:
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)


def _print_report(report: dict, show, json_path: Path, png: Optional[Path],
                  json_stdout: bool) -> None:
    if json_stdout:
        emit_json(report)
        return
    show(report)
    console.print(f"JSON report: {json_path}" + (f"; plot: {png}" if png else ""))


@app.command()
@handles_errors
def bench(target: Path = typer.Argument(..., help="Bundle folder, or a recipe: then a bench "
                                        "bundle with Ks 0..8 (or 0 and --ks) is built first, "
                                        "exports from the cache."),
          set_: Optional[List[str]] = SetOpt,
          prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompt file: JSONL "
                                                 "with a \"prompt\" (or \"text\") key, or one "
                                                 "prompt per line."),
          prompt_set: Optional[str] = typer.Option(None, "--prompt-set", help="Shipped prompts: "
                                                   "code | echo | prose (default: code)."),
          num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use the first "
                                                    "N prompts only."),
          ks: Optional[str] = typer.Option(None, "--ks", help="Ks to measure: 1-8, 1,2,4 "
                                           "(default: every compiled K > 0)."),
          methods: Optional[str] = typer.Option(None, "--methods", help="Comma list of "
                                                "draft_model, ngram, suffix (default: all the "
                                                "bundle supports)."),
          max_new_tokens: int = typer.Option(128, help="New tokens per prompt."),
          repeats: int = typer.Option(3, min=1, help="Measured repeats (a warm-up pass comes "
                                      "first and is not counted)."),
          peers: str = typer.Option("transformers,onnxruntime-genai,llama.cpp", help="Peers to "
                                    "run when installed (comma list), or 'none'."),
          peer_ks: Optional[str] = typer.Option(None, "--peer-ks", help="Ks for the peers' "
                                                "speculative decoding (default: --ks)."),
          cache_dir: Optional[Path] = typer.Option(None, help="Build cache (also holds the "
                                                   "onnxruntime-genai models of the peers)."),
          bundle_dir: Optional[Path] = typer.Option(None, "--bundle-dir", help="Where a recipe's "
                                                    "bench bundle goes (default: its output + "
                                                    "'-bench')."),
          json_out: Optional[Path] = typer.Option(None, "--json-out", help="JSON report (default: "
                                                  "bench-<name>.json next to the bundle)."),
          plot: Optional[Path] = typer.Option(None, "--plot", help="PNG plot (default: the JSON "
                                              "path with .png)."),
          no_plot: bool = typer.Option(False, "--no-plot", help="Skip the plot."),
          json_stdout: bool = typer.Option(False, "--json", help="Print the JSON report instead "
                                           "of the tables."),
          numerics: bool = typer.Option(False, "--numerics", help="Numerics preview (a recipe): "
                                        "fp32 against the card's mxfp6 weights + mxint8 KV "
                                        "emulated on the CPU, side by side: acceptance, tau, the "
                                        "K tune would pick, greedy agreement, logit drift "
                                        "(--ks: the K to run, default the recipe's largest).")):
    """Measure every method and K of a bundle, target-only, and the installed peers side by side."""
    from .bench import bench as run_bench, parse_ks, show_report

    if numerics:
        from .bench import bench_numerics, show_numerics
        from .errors import UsageError

        chosen = parse_ks(ks)
        if chosen is not None and len(chosen) != 1:
            raise UsageError("--numerics runs one K: give --ks K")
        report, json_path, png = bench_numerics(
            target, overrides=set_ or [], prompt_file=prompts, prompt_set=prompt_set,
            num_prompts=num_prompts, k=chosen[0] if chosen else None,
            max_new_tokens=max_new_tokens, cache_dir=cache_dir, bundle_out=bundle_dir,
            json_out=json_out, plot=False if no_plot else plot, say=_progress_line)
        _print_report(report, show_numerics, json_path, png, json_stdout)
        return
    peer_list = tuple(p.strip() for p in peers.split(",") if p.strip() and p.strip() != "none")
    report, json_path, png = run_bench(
        target, overrides=set_ or [], prompt_file=prompts, prompt_set=prompt_set,
        num_prompts=num_prompts, ks=parse_ks(ks),
        methods=[m.strip() for m in methods.split(",") if m.strip()] if methods else None,
        max_new_tokens=max_new_tokens, repeats=repeats, peers=peer_list,
        peer_ks=parse_ks(peer_ks), cache_dir=cache_dir, bundle_out=bundle_dir,
        json_out=json_out, plot=False if no_plot else plot, say=_progress_line)
    _print_report(report, show_report, json_path, png, json_stdout)
    if not report["all_greedy_outputs_match"]:
        bad = [r["label"] for r in report["rows"] if r["greedy_matches_target_only"] is False]
        err_console.print(f"[red]error:[/] greedy outputs differ from target-only for: "
                          f"{', '.join(bad)} (see {json_path})")
        raise typer.Exit(1)


@app.command()
@handles_errors
def tune(recipe: Path = RecipeArg, set_: Optional[List[str]] = SetOpt,
         k_max: int = typer.Option(8, "--k-max", help="Largest K to consider (calibration runs "
                                   "at K_max)."),
         prompts: Optional[Path] = typer.Option(None, "--prompts", help="Calibration prompts "
                                                "(JSONL or one per line; default: the shipped "
                                                "code set)."),
         prompt_set: Optional[str] = typer.Option(None, "--prompt-set", help="code | echo | "
                                                  "prose"),
         num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use the first "
                                                   "N prompts only."),
         max_new_tokens: int = typer.Option(128, help="New tokens per calibration prompt."),
         rounds: int = typer.Option(20, min=3, help="Timed calls per K for the cost medians."),
         cache_dir: Optional[Path] = typer.Option(None, help="Build cache (default: the user "
                                                  "cache dir, or $QPCBUILD_CACHE)."),
         write: Optional[Path] = typer.Option(None, "--write", help="Write the recipe with the "
                                              "chosen K and the evidence as comments to this "
                                              "file."),
         in_place: bool = typer.Option(False, "--in-place", help="Rewrite the recipe's "
                                       "num_speculative_tokens line (other lines are kept)."),
         json_out: bool = typer.Option(False, "--json", help="Print the evidence and decision "
                                       "as JSON."),
         cost_model: bool = typer.Option(False, "--cost-model", help="Call costs from a roofline "
                                         "model of the recipe's card (shapes, precision, the "
                                         "card's published bandwidth and fp16 compute per QID) "
                                         "instead of timing them here; acceptance is measured "
                                         "as always."),
         card_bandwidth_gbs: Optional[float] = typer.Option(None, "--card-bandwidth-gbs",
                                                            help="With --cost-model: DRAM GB/s "
                                                            "per QID (default: the card's "
                                                            "published figure)."),
         card_tflops: Optional[float] = typer.Option(None, "--card-tflops", help="With "
                                                     "--cost-model: fp16 TFLOPS per QID "
                                                     "(default: the card's published figure)."),
         per_batch: Optional[str] = typer.Option(None, "--per-batch", help="Batch sizes (1,2,4 "
                                                 "or 1-4): the best K for each too, recorded "
                                                 "in the evidence.")):
    """Pick K from measured acceptance and costs (expected tokens per second), and record why."""
    from .errors import UsageError
    from .bench import parse_ks
    from .tune import show_tune, tune as run_tune, write_tuned_recipe

    if write is not None and in_place:
        raise UsageError("give --write FILE or --in-place, not both")
    result = run_tune(recipe, set_ or [], k_max=k_max, prompt_file=prompts,
                      prompt_set=prompt_set, num_prompts=num_prompts,
                      max_new_tokens=max_new_tokens, rounds=rounds, cache_dir=cache_dir,
                      say=_progress_line, cost_model=cost_model,
                      card_bandwidth_gbs=card_bandwidth_gbs, card_tflops=card_tflops,
                      per_batch=parse_ks(per_batch))
    written = None
    if write is not None or in_place:
        written = write_tuned_recipe(recipe, result, None if in_place else write)
        result["written"] = str(written)
        if set_:
            err_console.print("[yellow]note:[/] only num_speculative_tokens was written; the "
                              f"--set overrides used while measuring ({', '.join(set_)}) were "
                              "not")
    if json_out:
        emit_json(result)
        return
    show_tune(result)
    if written:
        console.print(f"wrote {written}")

"""Commands that turn a recipe into a bundle: plan, export, compile; and version."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

from .app import RecipeArg, SetOpt, app, emit_json, handles_errors, progress_line
from .refs import InsecureOpt
from .render import console, err_console

if TYPE_CHECKING:
    from ..recipe.changes import RecipeChanges
    from ..tune.decision import Decision


@app.command()
@handles_errors
def plan(recipe: Path = RecipeArg, set_: Optional[List[str]] = SetOpt,
         json_out: bool = typer.Option(False, "--json", help="One JSON document (for CI)."),
         resolved: bool = typer.Option(False, "--resolved",
                                       help="Print the resolved recipe (defaults filled in)."),
         units: bool = typer.Option(False, "--units", help="List the independent build units "
                                    "(each export, backend artifact and QPC) with their cache "
                                    "keys and dependencies, for `compile --unit` on many "
                                    "machines; this digests the weights.")):
    """Validate a recipe and show exactly what `compile` will build. Reads configs, never weights
    (except with --units)."""
    from ..plan import make_plan
    from ..recipe import load_recipe
    from .render import show_plan
    import yaml

    r = load_recipe(recipe, set_ or [])
    if resolved:
        sys.stdout.write(yaml.safe_dump(r.to_yaml_dict(), sort_keys=False))
        return
    p = make_plan(r)
    if units:
        from ..bundle.units import plan_units
        from ..cache import Cache

        found = plan_units(p, Cache())
        if json_out:
            emit_json({"recipe": str(recipe), "name": r.name,
                       "units": [u.to_dict() for u in found]})
        for n, u in enumerate([] if json_out else found):
            console.print(f"{n:>2} {u.name:<20} {u.kind}-{u.key}  after: "
                          f"{', '.join(u.deps) or '-'}", markup=False)
    elif json_out:
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

    from ..export import export_model
    from ..errors import UsageError
    from ..models.source import resolve

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


# Over 80 lines: a third are Typer option declarations; the body runs the steps in the order
# the user sees them (plan, cache, build, optional tune).
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
            no_cache: bool = typer.Option(False, "--no-cache", help="Build everything afresh "
                                          "and move it into the bundle: a one-shot build (a "
                                          "fresh CI container) needs disk for one copy of the "
                                          "graphs, not two."),
            jobs: int = typer.Option(2, min=1, help="Export target and draft concurrently "
                                     "(--no-cache exports one role at a time)."),
            smoke_weights: bool = typer.Option(False, "--smoke-weights", help="Use random weights "
                                               "of the recipe's exact shapes (for checking a "
                                               "recipe without the real checkpoint)."),
            smoke_layers: int = typer.Option(2, min=0, help="With --smoke-weights: layers "
                                             "per model (0 = all)."),
            tune_k: bool = typer.Option(False, "--tune", help="Pick K first from measured "
                                        "acceptance and costs (`qpcbuild tune` with its "
                                        "defaults) and record the evidence; the recipe's other "
                                        "Ks below K are kept, as `tune --write` keeps them."),
            tune_cost_model: bool = typer.Option(
                False, "--tune-cost-model", help="With --tune: call costs from the card's "
                "roofline model instead of timing them here (for a shared or busy runner; "
                "labelled so in the evidence)."),
            tune_force: bool = typer.Option(
                False, "--tune-force", help="With --tune: build even when tune's own model check "
                "contradicts the costs K rests on (as `tune --write --force`)."),
            remote_cache: Optional[str] = typer.Option(
                None, "--remote-cache", envvar="QPCBUILD_REMOTE_CACHE", help="REGISTRY/REPO "
                "shared by builders: each artifact missing locally is pulled from it, or built "
                "and pushed to it (one tag per cache key)."),
            remote_cache_required: bool = typer.Option(
                False, "--remote-cache-required", envvar="QPCBUILD_REMOTE_CACHE_REQUIRED",
                help="Fail when the remote cache is down or refuses (default: warn, build "
                "locally)."),
            insecure: bool = InsecureOpt,
            unit: Optional[str] = typer.Option(None, "--unit", help="Build only this unit (name "
                                               "or index from `plan --units`) into the cache; "
                                               "no bundle."),
            push_ref: Optional[str] = typer.Option(
                None, "--push", help="REGISTRY/REPO:TAG: publish the bundle there instead of "
                "writing a folder (print the digest to pin); with --remote-cache, files the "
                "cache's registry holds are mounted, never downloaded."),
            json_out: bool = typer.Option(False, "--json", help="One JSON result at the end.")):
    """Build the bundle: export both models, compile for each backend, write the manifest."""
    import tempfile
    import time
    from contextlib import ExitStack

    from ..bundle import build_bundle
    from ..errors import UsageError
    from ..registry.remote_cache import open_cache
    from ..plan import make_plan
    from ..recipe import load_recipe

    if no_cache and (cache_dir or remote_cache or unit):
        raise UsageError("--no-cache contradicts --cache-dir, --remote-cache and --unit (they "
                         "all need a cache); pass one or the other")
    if unit is not None and (emit_only or tune_k):
        raise UsageError("--unit builds one cached artifact; it cannot be combined with "
                         "--emit-only or --tune")
    if smoke_weights and (cache_dir or remote_cache or unit):
        raise UsageError("--smoke-weights builds without the cache (random weights are a check, "
                         "not an artifact to keep); drop --cache-dir, --remote-cache and --unit")
    if push_ref is not None and (out is not None or unit is not None):
        raise UsageError("--push publishes the bundle to a registry instead of a folder, so it "
                         "cannot be combined with -o or --unit; to keep a folder too, build "
                         "with -o and run `qpcbuild push DIR REF`")
    if no_cache and tune_k:
        raise UsageError("--no-cache cannot be combined with --tune: tuning measures bundles "
                         "built through the cache")
    tuning, tuned = None, None
    if (tune_cost_model or tune_force) and not tune_k:
        raise UsageError("--tune-cost-model and --tune-force go with --tune")
    if tune_k:
        if smoke_weights:
            raise UsageError("--tune measures the real models; it cannot be combined with "
                             "--smoke-weights")
        tuned, tuning = _tuned(recipe, set_ or [], cache_dir, json_out, tune_cost_model,
                               tune_force)
    push_to = _pusher(push_ref, insecure, json_out)  # a bad reference fails before any work
    r = load_recipe(recipe, set_ or [], tuned)
    # Smoke weights are a check, not an artifact: their random checkpoints and graphs live
    # only as long as this build (checkpoints in $TMPDIR, graphs moved into the bundle), never
    # in the shared cache, so that an 8B check leaves the bundle behind and nothing else.
    cache = None if no_cache or smoke_weights else open_cache(
        cache_dir, remote_cache, remote_cache_required, insecure,
        say=lambda m: err_console.print(f"[yellow]warning:[/] {m}", soft_wrap=True))
    with ExitStack() as scratch:
        if smoke_weights:
            from ..smoke import with_smoke_weights
            smoke_dir = Path(scratch.enter_context(
                tempfile.TemporaryDirectory(prefix="qpcbuild-smoke-")))
            r = with_smoke_weights(r, smoke_dir, smoke_layers or None,
                                   say=lambda m: err_console.print(m))
        plan_ = make_plan(r, compiler, cache.root / "digests" if cache else None)
        started = time.perf_counter()

        def progress(stage: str, how: str, seconds: float) -> None:
            if not json_out:
                mark = {"built": "[green]✓[/]", "pulled": "[blue]⇣[/]"}.get(how, "[cyan]↺[/]")
                console.print(f"{mark} {stage:<28} {how:<7} {seconds:6.1f} s   "
                              f"(elapsed {time.perf_counter() - started:.1f} s)")

        for w in plan_.warnings:
            err_console.print(f"[yellow]warning:[/] {w}")
        units = None
        if unit is not None:
            from ..bundle.units import plan_units, select_unit
            units = {select_unit(plan_units(plan_, cache, compiler), unit).name}
        result = build_bundle(plan_, cache=cache, out=out, emit_only=emit_only,
                              compiler=compiler, jobs=jobs, progress=progress,
                              manifest_extra={"tuning": tuning.to_json()} if tuning else None, units=units,
                              push=push_to and push_to(scratch))
    if json_out:
        emit_json({**result.to_dict(), **({"tuning": {
            "chosen_k": tuning.chosen_k, "recommended_ks": list(tuning.recommended_ks),
            "file": "manifest.json"}} if tuning else {})})
    elif units:
        console.print(f"unit {', '.join(units)} is in the cache ({result.seconds:.1f} s)")
    elif result.pushed:
        p = result.pushed
        console.print(f"bundle id {result.bundle_id[:16]} built in {result.seconds:.1f} s and "
                      f"pushed to {push_ref} ({p['files']} files, {p['bytes']:,} bytes, "
                      f"{p['transferred_bytes']:,} uploaded)")
        print(p["pinned"])
    else:
        console.print(f"bundle [bold]{result.bundle}[/] id {result.bundle_id[:16]} built in "
                      f"{result.seconds:.1f} s")
        if tuning is not None:
            console.print(f"K={tuning.chosen_k} from tuning; evidence in the manifest (key "
                          "tuning)")


def _tuned(recipe: Path, sets: list[str], cache_dir: Path | None, json_out: bool,
           cost_model: bool, force: bool) -> tuple[RecipeChanges, Decision]:
    """`compile --tune`: tune, then the recipe's K by the rule `tune --write` follows (same
    kept Ks, the confidence stop's Ks and threshold when it won, a contradicted model check
    refused unless forced). Returns (tune's choice as changes to the recipe, the evidence)."""
    from ..recipe import load_recipe
    from ..recipe.changes import RecipeChanges
    from ..tune import show_tune, tune as run_tune
    from ..tune.recipe_edit import tuned_k_value
    from ..tune.report import disagreements, refuse_if_contradicted

    tuning = disagreements(run_tune(recipe, sets, cache_dir=cache_dir, say=progress_line,
                                    cost_model=cost_model))
    if not json_out:
        show_tune(tuning, console)
    refuse_if_contradicted(tuning, force, "--tune-force", "nothing was built")
    for problem in tuning.model_check_disagrees or ():  # forced: said, then built
        err_console.print(f"[yellow]warning:[/] K={tuning.chosen_k} rests on costs its "
                          f"own check contradicts: {problem}", soft_wrap=True)
    before = load_recipe(recipe, sets).speculation.num_speculative_tokens
    stop = tuning.winning_stop
    value = tuned_k_value(before, tuning.chosen_k, stop)
    return RecipeChanges(speculation={"num_speculative_tokens": value} if stop is None else
                         {"num_speculative_tokens": value,
                          "draft_p_min": stop.draft_p_min}), tuning


def _pusher(ref: str | None, insecure: bool, quiet: bool):
    """For compile --push: None, or (exit stack -> the build's publish step) that pushes the
    sealed bundle under `ref` with a client the stack closes."""
    if ref is None:
        return None
    from ..errors import UsageError
    from ..registry.bundles import push_assembled
    from ..registry.client import RegistryClient
    from ..registry.reference import parse_reference

    reference = parse_reference(ref, "--push")
    if reference.digest:
        raise UsageError(f"--push {ref}: push to a tag; the registry gives the digest")

    def publish_with(stack):
        client = stack.enter_context(RegistryClient(reference.registry, insecure))
        client.ping()  # a registry that is not there fails now, not after the build

        def publish(staging: Path, sources: dict) -> dict:
            done = push_assembled(staging, sources, reference, client,
                                  None if quiet else progress_line)
            return {"reference": str(reference), **done.to_dict(),
                    "pinned": f"{reference.registry}/{reference.repository}@{done.digest}"}
        return publish
    return publish_with


@app.command()
def version():
    """Print versions of qpcbuild and its toolchain."""
    from ..toolchain import versions
    emit_json(versions())

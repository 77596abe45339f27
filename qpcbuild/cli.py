"""The `qpcbuild` command line: parse, call one stage, render. No logic lives here.

Exit codes: 0 success; 1 build, toolchain or bundle failure; 2 bad input (recipe, model folder,
bundle path, CLI argument).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Callable, List, Optional

import typer

from . import __version__
from .errors import QpcbuildError
from .render import console, err_console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build and package speculative-decoding model pairs for Qualcomm Cloud AI "
                       "100 (qaic) and ONNX Runtime, and run them.")

RecipeArg = typer.Argument(..., help="Recipe YAML file (see recipes/).", show_default=False)
SetOpt = typer.Option(None, "--set", help="Override a recipe key: --set shapes.ctx_len=4096 "
                      "(repeatable).")


def handles_errors(fn: Callable) -> Callable:
    """Users get a message and an exit code, never a stack trace."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QpcbuildError as exc:
            err_console.print(f"[red]error:[/] {exc}", soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[red]interrupted[/]")
            raise typer.Exit(130) from None
    return wrapper


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
           check: bool = typer.Option(True, help="Run onnx.checker (full check) on the result.")):
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
                       continuous_batching=continuous_batching, weight_dtype=weight_dtype)
    if check:
        import onnx
        onnx.checker.check_model(str(res.onnx_path), full_check=True)
    console.print(f"exported {res.arch.architecture} ({res.arch.param_count:,} parameters) as "
                  f"{role} to {res.onnx_path} in {time.perf_counter() - start:.1f} s; weights "
                  f"digest {res.weights_digest[:16]}")


def _not_built(name: str, issue: str) -> Callable:
    def command():
        err_console.print(f"[yellow]`qpcbuild {name}` is not built yet[/] ({issue}); see README "
                          "'Status'.")
        raise typer.Exit(2)
    command.__doc__ = f"[not built yet] {issue}"
    return command


@app.command()
def version():
    """Print versions of qpcbuild and its toolchain."""
    from .toolchain import versions
    emit_json(versions())


def main() -> None:  # pragma: no cover
    app()

"""The `qpcbuild` command line: parse, call one stage, render. No logic lives here.

One module per group of commands, in the order `qpcbuild --help` lists them: build.py (plan,
export, compile, version), bundles.py (verify, finish, inspect, doctor, package, unpack, cache),
run.py (run, serve, serve-config), measure.py (bench, tune); app.py holds the Typer app and what
they share; render.py the terminal views and serve_config.py what `serve-config` prints (a
bundle's manifest as vLLM's settings); nothing below the CLI imports either.

Exit codes: 0 success; 1 build, toolchain or bundle failure; 2 bad input (recipe, model folder,
bundle path, CLI argument).
"""

# Each module registers its commands on import; this order is the order of `--help`.
from . import build, bundles, run, measure, registry  # noqa: F401  (imported to register)
from .app import app, emit_json, error_object, handles_errors


def main() -> None:  # pragma: no cover
    app()


__all__ = ["app", "emit_json", "error_object", "handles_errors", "main"]

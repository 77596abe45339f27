"""The Typer application and what every command shares: error handling (a message and an exit
code, never a stack trace), JSON output and the common arguments."""

from __future__ import annotations

import errno
import functools
import json
import signal
import sys
import threading
from typing import Callable

import typer

from ..errors import QpcbuildError, Terminated
from ..progress import report_to
from .render import err_console, fit_to_output

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build and package speculative-decoding model pairs for Qualcomm Cloud AI "
                       "100 (qaic) and ONNX Runtime, and run them.")


def _show_version(value: bool) -> None:
    if value:
        from ..version import __version__
        sys.stdout.write(f"qpcbuild {__version__}\n")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True,
                                          callback=_show_version,
                                          help="Print qpcbuild's version and exit.")) -> None:
    pass  # the options of `qpcbuild` itself; the app's help text says what it does


def _flag_types_hidden() -> None:
    """Typer's help prints a type for every option, `<bool>` for flags that take no value;
    a flag's type says nothing, so it is left out."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich


_flag_types_hidden()

RecipeArg = typer.Argument(..., help="Recipe YAML file (see recipes/).", show_default=False)
SetOpt = typer.Option(None, "--set", help="Override a recipe key: --set shapes.ctx_len=4096 "
                      "(repeatable).")


# A full disk (or quota) ends a command with a message, not a stack trace: each writer removes
# what it had half written as the error passes through it.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _terminate(signum, frame):
    Terminated.requested = True
    raise Terminated()


def handles_errors(fn: Callable) -> Callable:
    """Users get a message and an exit code, never a stack trace. SIGTERM unwinds like Ctrl-C,
    so a killed build removes its staging folder and temp cache entries."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _terminate) if main else None
        fit_to_output()  # whole lines in a log, fitted lines on a terminal
        report_to(err_console)  # long steps: bars on a terminal, one line each in a log
        try:
            return fn(*args, **kwargs)
        except QpcbuildError as exc:
            err_console.print(f"[red]error:[/] {exc}", soft_wrap=True)
            if kwargs.get("json_out") is True or kwargs.get("json_stdout") is True:
                emit_json({"error": error_object(exc)})  # CI parses stdout
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            where = f" while writing {exc.filename}" if exc.filename else ""
            err_console.print(f"[red]error:[/] out of disk space{where} ({exc.strerror}); "
                              "what this command was writing has been removed: free some space "
                              "(`qpcbuild cache prune` frees the build cache) and run it again",
                              soft_wrap=True)
            raise typer.Exit(1) from None
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
    from ..errors import RecipeError

    where = [{"path": p.path, "line": p.line, "message": p.message}
             for p in exc.problems] if isinstance(exc, RecipeError) else None
    return {"code": exc.exit_code, "type": type(exc).__name__, "message": str(exc),
            "where": where}


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")



def progress_line(message: str) -> None:
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)

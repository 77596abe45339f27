"""The `qpcbuild` command's entry point. Importing the command line (typer, rich, every command
module) takes a moment; Ctrl-C in that moment ends the command like Ctrl-C anywhere else:
"interrupted", exit 130, no traceback."""

import sys


def _interrupted(exc: BaseException) -> bool:
    """A KeyboardInterrupt, or an error Python raised because one arrived mid-statement: an
    interrupt inside a class body's __set_name__ (e.g. the stdlib's platform module, imported
    by typer) comes out as RuntimeError("Error calling __set_name__ ...") caused by it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def main() -> None:
    try:
        from .ort_threads import allow_shared_pool
        from .cli import app

        allow_shared_pool()  # this process owns its ONNX Runtime: see ort_threads
        # app() first builds the click command from every command's signature (a moment more)
        # before click's own Ctrl-C handling starts; an interrupt that escapes came from there.
        app()
    except (KeyboardInterrupt, Exception) as exc:
        if not _interrupted(exc):
            raise
        sys.stderr.write("interrupted\n")
        sys.exit(130)

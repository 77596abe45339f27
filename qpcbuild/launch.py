"""The `qpcbuild` command's entry point. Importing the command line (typer, rich, every command
module) takes a moment; Ctrl-C in that moment ends the command like Ctrl-C anywhere else:
"interrupted", exit 130, no traceback."""

import sys


def main() -> None:
    try:
        from .cli import app
        # app() first builds the click command from every command's signature (a moment more)
        # before click's own Ctrl-C handling starts; an interrupt that escapes came from there.
        app()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)

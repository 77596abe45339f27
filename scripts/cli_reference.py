"""Write docs/cli.md, the command-line reference, from the Typer application itself.

The page is generated so that it cannot drift from the code: tests/test_docs.py regenerates it
and fails when the committed page differs. Run `python scripts/cli_reference.py` after changing
a command, an option or its help text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"


# Typer (0.29) carries its own copy of click, so commands and parameters are read by duck typing
# instead of isinstance checks against the `click` package.


def _usage(ctx, cmd) -> str:
    pieces = " ".join(cmd.collect_usage_pieces(ctx))
    return f"{ctx.command_path} {pieces}".strip()


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option_row(ctx, param) -> str:
    """One table row from the parameter's own help record (what `--help` shows)."""
    record = param.get_help_record(ctx)
    if record is None:  # a hidden parameter
        return ""
    names, help_text = record
    return f"| `{_cell(names)}` | {_cell(help_text)} |"


def _command_section(ctx, cmd, level: int) -> list[str]:
    out = [f"{'#' * level} `{ctx.command_path}`", ""]
    if cmd.help:
        out += [" ".join(cmd.help.split()), ""]
    out += ["```", _usage(ctx, cmd), "```", ""]
    params = [p for p in cmd.get_params(ctx) if p.name != "help"]
    if params:
        out += ["| argument or option | meaning |", "|---|---|"]
        out += [row for p in params if (row := _option_row(ctx, p))]
        out.append("")
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            out += _command_section(sub.context_class(sub, info_name=name, parent=ctx), sub,
                                    level + 1)
    return out


def render() -> str:
    from qpcbuild.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="qpcbuild")
    lines = ["# Command-line reference", "",
             "Generated from the Typer application by `python scripts/cli_reference.py`; "
             "`qpcbuild COMMAND --help` prints the same.", "",
             "Exit codes: `0` success, `1` build/toolchain failure or a damaged bundle, `2` bad "
             "input (recipe, model folder, CLI argument, prompt, a path that is not a bundle).",
             ""]
    for name in root.list_commands(ctx):
        cmd = root.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        lines += _command_section(cmd.context_class(cmd, info_name=name, parent=ctx), cmd, 2)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/cli.md differs from what the code gives")
    args = parser.parse_args()
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The package's version, in a module of its own at the bottom of the layers: plan, export,
bundle and toolchain record it, and importing it from the package root would run upward."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's [project] version


def code_version() -> str:
    """The code a measurement ran, for its report: `git describe --always --dirty` where the
    package is imported from a git checkout, else the package version (an installed wheel)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():  # a directory in a clone, a file in a worktree
        try:
            done = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                                  capture_output=True, text=True, timeout=30, check=True)
            return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):  # no git, or not a usable checkout
            pass
    return __version__

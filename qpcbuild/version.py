"""The package's version, in a module of its own at the bottom of the layers: plan, export,
bundle and toolchain record it, and importing it from the package root would run upward."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's [project] version

"""Errors that reach the user. Each carries the exit code the CLI returns for it."""

from __future__ import annotations

from dataclasses import dataclass


class QpcbuildError(Exception):
    """A failure with a message meant for the user (no stack trace)."""

    exit_code = 1


class UsageError(QpcbuildError):
    """Bad input: a recipe, a model folder, a CLI argument, a prompt. Exit code 2."""

    exit_code = 2


class BundleError(QpcbuildError):
    """A bundle that is corrupted, incomplete or built for something else. Exit code 1."""

    exit_code = 1


class ToolchainError(QpcbuildError):
    """An external tool (the Qualcomm compiler, qaicrt) is missing or failed. Exit code 1."""

    exit_code = 1


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that cleanup runs as for Ctrl-C."""

    # Set by the handler: an import interrupted by SIGTERM surfaces as an ImportError, which
    # must not be reported as a missing package.
    requested = False


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe: where (key path, line) and what."""

    path: str
    message: str
    line: int | None = None
    severity: str = "error"  # "error" | "warning"

    def __str__(self) -> str:
        where = f"{self.path}" + (f" (line {self.line})" if self.line else "")
        return f"{where}: {self.message}"


class RecipeError(UsageError):
    """All problems of a recipe at once, so the user fixes them in one pass."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s)"] + [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))

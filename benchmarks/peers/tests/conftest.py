"""The peers' tests run from the repository root (pyproject.toml: pytest's pythonpath), so that
`benchmarks.peers` imports as it does for run.py."""

from __future__ import annotations

import pytest


@pytest.fixture
def peer_manifest():
    """qpcbuild.testing.small_manifest: a checked Manifest whose roles' checkpoints are the
    folders given (the peer tests that need no built bundle)."""
    from qpcbuild.testing import small_manifest

    return small_manifest

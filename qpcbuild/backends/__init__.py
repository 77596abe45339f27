"""Compile backends: each turns a role's portable ONNX graph into its own compiled form.

A backend is one module behind one interface, found by name (backends.py: BACKENDS,
get_backend), so the bundle builder and the unit planner never know which one they drive:
- `check()` fails fast (before any export) when the backend cannot run here;
- `key_inputs()` is what its artifact's cache key is the digest of;
- `build_cached()` writes the role's artifacts under the staging bundle (from the cache when an
  entry exists) and returns the manifest entry that describes them.
"""

from __future__ import annotations

from .backends import BACKENDS, DEFAULT_BACKEND, backend_names, get_backend  # noqa: F401
from .interface import Backend, BuildContext  # noqa: F401

"""Bundles: build (build.py), the sealed manifest (manifest.py), verify (verify.py), the SDK
hand-off (finish.py) and archives (archive.py)."""

from .build import BuildResult, build_bundle
from .finish import finish_bundle
from .manifest import MANIFEST, read_manifest
from .verify import verify_bundle

__all__ = ["MANIFEST", "BuildResult", "build_bundle", "finish_bundle", "read_manifest",
           "verify_bundle"]

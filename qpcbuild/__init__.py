"""qpcbuild: build and package speculative-decoding model pairs for Cloud AI 100 and ONNX Runtime."""

from .version import __version__

__all__ = ["__version__", "load"]


def load(bundle, **options):
    """Open a bundle for generation: `qpcbuild.load("build/demo").generate([...])`.
    Options: backend, method, k, verify, ctx_len, batch_size (see runtime.loader.load)."""
    from .runtime.loader import load as _load
    return _load(bundle, **options)

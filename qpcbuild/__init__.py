"""qpcbuild: build and package speculative-decoding model pairs for Cloud AI 100 and ONNX Runtime."""

__version__ = "0.1.0"


def load(bundle, backend: str = "onnxruntime", method=None, k=None, verify: str = "full"):
    """Open a bundle for generation; see `qpcbuild.runtime.loader.load`."""
    from .runtime.loader import load as _load
    return _load(bundle, backend=backend, method=method, k=k, verify=verify)

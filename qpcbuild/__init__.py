"""qpcbuild: build and package speculative-decoding model pairs for Cloud AI 100 and ONNX Runtime.

The pipeline, a package or module per stage: recipe/ (the YAML file a user writes) and models/
(the model files it names) -> plan.py -> export/ (ONNX graphs) -> compile/ (one module per
backend) -> bundle/ -> runtime/, served by server/ and shared through registry/; bench/ and tune/
measure bundles and cli/ drives every stage. .importlinter lists the layers, and why each module
left at this level is here."""

from .version import __version__

__all__ = ["__version__", "load"]


def load(bundle, **options):
    """Open a bundle for generation: `qpcbuild.load("build/demo").generate([...])`.
    Options: backend, method, k, verify, ctx_len, batch_size (see runtime.loader.load)."""
    from .runtime.loader import load as _load
    return _load(bundle, **options)

"""qpcbuild: build and package speculative-decoding model pairs for Cloud AI 100 and ONNX Runtime."""

__version__ = "0.1.0"

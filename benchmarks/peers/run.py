"""`qpcbuild bench` with the peers that need a build or an environment of their own beside the
package's: llama.cpp through llama-cpp-python ("llama.cpp"), llama.cpp's own prompt-lookup and
speculative programs ("llama-lookup", "llama-speculative") and vLLM's CPU build ("vllm").

It takes every option `qpcbuild bench` takes and measures in the same way (one process, repeats
interleaved with ours); it only adds these peers first, through the package's public API
(`qpcbuild.bench.add_peers`). Without --peers it runs all of them and the package's own.

    make peers                                   # set them up (builds llama.cpp, vLLM's venv)
    export QPCBUILD_LLAMA_CPP_BIN=... QPCBUILD_VLLM_PYTHON=...   # what `make peers` printed
    python benchmarks/peers/run.py recipes/qwen-coder.yaml --prompt-set code --repeats 3
    python benchmarks/peers/run.py build/qwen-coder-bench --peers llama.cpp,vllm --json

A peer that is not set up is reported as skipped, with the reason, as in `qpcbuild bench`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.peers import PEERS  # noqa: E402  (after its sys.path entry)
from qpcbuild.bench import DEFAULT_PEERS, add_peers  # noqa: E402  (after its sys.path entry)
from qpcbuild.cli import app  # noqa: E402  (after its sys.path entry)


def main(argv: list[str]) -> None:
    add_peers(PEERS)
    if not any(a == "--peers" or a.startswith("--peers=") for a in argv):
        argv = [*argv, "--peers", ",".join([*DEFAULT_PEERS, *PEERS])]
    app(["bench", *argv], prog_name="benchmarks/peers/run.py")


if __name__ == "__main__":
    main(sys.argv[1:])

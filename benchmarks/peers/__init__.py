"""The peers `qpcbuild bench` does not carry, because a pip install cannot provide them: llama.cpp
(llama-cpp-python built from source, and llama.cpp's own programs) and vLLM's CPU build (an
environment of its own). They are measured from a checkout, through the package's public API:
run.py adds them to bench's peers and runs `qpcbuild bench` (docs/bench.md, "Peers that need a
build"). get_peers.py sets them up (`make peers`)."""

from __future__ import annotations

from qpcbuild.bench import PeerMaker

from .llama_cpp import llama_cpp_peer, llama_lookup_peer, llama_speculative_peer
from .vllm_peer import vllm_peer

PEERS: dict[str, PeerMaker] = {"llama.cpp": llama_cpp_peer,
                               "llama-lookup": llama_lookup_peer,
                               "llama-speculative": llama_speculative_peer,
                               "vllm": vllm_peer}

"""The peers `qpcbuild bench` does not carry, because a pip install cannot provide them: llama.cpp
(llama-cpp-python built from source, and llama.cpp's own programs) and vLLM's CPU build (an
environment of its own). They are measured from a checkout, through the package's public API:
run.py adds them to bench's peers and runs `qpcbuild bench` (docs/bench.md, "Peers that need a
build"). get_peers.py sets them up (`make peers`)."""

from __future__ import annotations

from qpcbuild.bench import PeerMaker

from .llama_cpp import (llama_cpp_peer, llama_lookup_peer, llama_speculative_peer,
                        on_quantized_target)
from .vllm_peer import vllm_peer

# The precisions get_peers.py can write the target's GGUF at besides float32 (`--target-types`):
# each adds a llama-lookup (target-only and prompt lookup) and a llama-speculative peer on it.
QUANTIZED_TARGETS = ("q8_0", "q4_0", "q4_k_m")

PEERS: dict[str, PeerMaker] = {
    "llama.cpp": llama_cpp_peer,
    "llama-lookup": llama_lookup_peer,
    "llama-speculative": llama_speculative_peer,
    **{f"llama-lookup-{kind}": on_quantized_target(llama_lookup_peer, kind)
       for kind in QUANTIZED_TARGETS},
    **{f"llama-speculative-{kind}": on_quantized_target(llama_speculative_peer, kind)
       for kind in QUANTIZED_TARGETS},
    "vllm": vllm_peer}

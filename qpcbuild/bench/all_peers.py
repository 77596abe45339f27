"""Every peer `bench` can run, by the name `--peers` takes. A module of its own: the peers in
llama_cpp.py and vllm_peer.py build on peers.py, which therefore cannot list them."""

from __future__ import annotations

from typing import Callable

from .llama_cpp import llama_cpp_peer, llama_lookup_peer, llama_speculative_peer
from .peers import Peer, ort_genai_peer, transformers_peer
from .vllm_peer import vllm_peer

PEERS: dict[str, Callable[..., Peer]] = {"transformers": transformers_peer,
                                         "onnxruntime-genai": ort_genai_peer,
                                         "llama.cpp": llama_cpp_peer,
                                         "llama-lookup": llama_lookup_peer,
                                         "llama-speculative": llama_speculative_peer,
                                         "vllm": vllm_peer}

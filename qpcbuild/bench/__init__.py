"""`qpcbuild bench`: every method and K a bundle supports, target-only, and the peers a user would
otherwise pick, measured side by side in one run on one prompt set.

What one run does
-----------------
* Ours: each method the bundle supports (draft_model when it has a draft; ngram and suffix always,
  they need no model) at each requested K, plus target-only decoding at the smallest compiled K
  (ideally 0). All methods share one set of ONNX Runtime sessions (`Generator.sibling`).
* Peers, when installed (never faked; a missing one is reported as skipped with the reason):
  Hugging Face transformers on PyTorch/CPU (target-only, assisted generation with the draft at
  each K and with transformers' own defaults, prompt lookup at each K) and onnxruntime-genai on
  the same checkpoints (target-only, and its speculative decoding: draft model and n-gram). The
  peers that need a build or an environment of their own (llama.cpp, vLLM's CPU build) are in a
  checkout's benchmarks/peers/, which adds them with `add_peers` and runs bench (docs/bench.md).
* Repeats are interleaved (each repeat runs every configuration, ours and the peers', over the
  whole prompt set in turn), so drift of a busy machine hits all of them alike while each runs
  warm as it would in use. A warm-up pass on the first prompt comes first and is not counted.
* Greedy decoding throughout; each configuration's tokens are compared with our target-only
  tokens (ours must match exactly; a peer's match is reported, not required).

tokens/s = new tokens / wall time of the generate calls (prefill included), per repeat; the
table shows the mean and the standard deviation over repeats. speedup = tokens/s / target-only
tokens/s of the same run (the spread is that of the per-repeat ratios).

Parts: measure.py (our measurement and the entry point), records.py (one measured
configuration), peers.py (the peers), report.py (report, JSON, tables,
markdown), plot.py. Ks, prompt sets and the measurement bundle come from qpcbuild/measuring.py,
which `tune` shares; `bench --numerics` is qpcbuild/numerics_bench.py (it uses both).
"""

from ..measuring import (BENCH_KS, PROMPT_DIR, PROMPT_SETS, Say, build_for_measurement,
                         build_on_card, default_bench_dir, is_bundle, load_prompts, machine_info,
                         measurement_changes, parse_ks)
from ..prompts import read_prompt_file
from ..recipe import METHODS
from .measure import DEFAULT_PEERS, bench, run_bench
from .peers import (NO_CHECKPOINT, PEERS, Peer, PeerMaker, add_peers, find_peer,
                    local_source)
from .plot import plot_report
from .records import Measure
from .report import (build_report, default_json_path, markdown_table, show_report,
                     write_json)

__all__ = ["BENCH_KS", "DEFAULT_PEERS", "METHODS", "NO_CHECKPOINT", "PEERS", "PROMPT_DIR",
           "PROMPT_SETS", "Measure", "Peer", "PeerMaker", "Say", "add_peers", "bench",
           "build_for_measurement", "build_on_card", "build_report", "default_bench_dir",
           "default_json_path", "find_peer", "is_bundle", "load_prompts", "local_source",
           "machine_info", "markdown_table", "measurement_changes", "parse_ks", "plot_report",
           "read_prompt_file", "run_bench", "show_report", "write_json"]

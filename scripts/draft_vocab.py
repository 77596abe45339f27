"""A draft's vocabulary subset (a recipe's `draft.vocab_subset`) for a published tokenizer, chosen
without running either model.

The draft proposes only tokens of the subset; the target still verifies every position, so the
output is the same with or without it and a token outside the subset only costs the proposals
that needed it. What it buys is a smaller LM head: Qwen2.5-Coder-0.5B's 151,936-row head is a
quarter of its weights, read on every draft call.

Which tokens: the union of
- the N most frequent tokens of the Python standard library's source (code, docstrings and the
  English of `pydoc_data`), nine files in ten; the tenth is held out to report coverage, and
- the first M ids of the tokenizer. A byte-level BPE numbers its tokens in merge order, and its
  earliest merges are the commonest pieces of its own training text, which covers the prose and
  chat words the standard library lacks (on the prose prompts the stdlib's top 32,768 alone
  covered 79% of the tokens, with the first 16,384 ids added 91%).

The result depends on the tokenizer and on the stdlib of the Python that runs this, so it is
the same on every machine with the same Python minor version; both are recorded in the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_corpus import stdlib_sources

SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo"}
MOST_FREQUENT, FIRST_IDS = 32768, 16384


def _provenance(tokenizer: Path, most_frequent: int, first_ids: int) -> dict:
    return {"tokenizer_sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest(),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "most_frequent": most_frequent, "first_ids": first_ids}


def choose(tokenizer: Path, most_frequent: int, first_ids: int) -> dict:
    """The subset's file contents: sorted token ids, how they were chosen, held-out coverage."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer))
    counts: Counter[int] = Counter()
    held: list[int] = []
    for i, (_, path) in enumerate(stdlib_sources(SKIPPED_DIRS)):
        try:
            ids = tok.encode(path.read_text(encoding="utf-8")).ids
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are not UTF-8 text; they are not needed
        if i % 10 == 9:
            held += ids
        else:
            counts.update(ids)
    keep = {t for t, _ in counts.most_common(most_frequent)} | set(range(first_ids))
    keep = {t for t in keep if t < tok.get_vocab_size()}
    coverage = sum(t in keep for t in held) / max(1, len(held))
    return {"token_ids": sorted(keep),
            "chosen_by": f"the {most_frequent} most frequent tokens of the Python "
                         f"{sys.version_info.major}.{sys.version_info.minor} standard library's "
                         f"source (9 files in 10) and the tokenizer's first {first_ids} ids",
            "heldout_coverage": round(coverage, 4),
            "provenance": _provenance(tokenizer, most_frequent, first_ids)}


def write(tokenizer: Path, out: Path, log=print) -> Path:
    """Write the subset to `out` unless it is already there for this tokenizer and Python; the
    file is replaced atomically, so an interrupted run leaves the old one or none."""
    try:
        old = json.loads(out.read_text())
        if old.get("provenance") == _provenance(tokenizer, MOST_FREQUENT, FIRST_IDS) and old.get("token_ids"):
            log(f"{out} is up to date ({len(old['token_ids'])} tokens)")
            return out
    except (FileNotFoundError, ValueError):
        pass
    data = choose(tokenizer, MOST_FREQUENT, FIRST_IDS)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data) + "\n")
    tmp.replace(out)
    log(f"wrote {out}: {len(data['token_ids'])} tokens, covering "
        f"{data['heldout_coverage']:.1%} of the held-out stdlib tokens")
    return out

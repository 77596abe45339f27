"""Acceptance evidence for `qpcbuild tune`: greedy runs summed over a prompt set, and the
engine's own loop replayed over the target's greedy outputs at every K (`runtime.replay.replay`:
the real proposer or draft, the real acceptance and statistics; only the target is read off the
known outputs). Per-position acceptance depends on K (acceptance comes in runs, and a larger K
spends fewer steps on a run, so the steps it takes start more often where the proposer
disagrees), which is why each K is replayed rather than extrapolated."""

from __future__ import annotations

from typing import Any

from ..runtime.replay import replay
from ..runtime.rows import prefill_calls
from ..runtime.stats import summarize
from .model import conditional_acceptance


def summed_run(gen, ids: list[list[int]], max_new_tokens: int, k: int | None,
         target_only: bool = False) -> dict[str, Any]:
    """Greedy generation over `ids` in batches; summed statistics."""
    batch, prefill = gen.target.batch_size, gen.manifest.shapes.prefill_seq_len
    ctx_len = gen.target.ctx_len
    t = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "target_calls": 0, "draft_calls": 0,
         "target_s": 0.0, "draft_s": 0.0, "e2e_s": 0.0, "prefill_s": 0.0, "host_s": 0.0,
         "new_tokens": 0, "rows": 0, "prefill_calls": 0, "per_pos": []}
    t["outputs"] = []
    for start in range(0, len(ids), batch):
        chunk = ids[start:start + batch]
        res = gen.generate(chunk, max_new_tokens, k=k, target_only=target_only)
        st = res.stats
        t["outputs"] += [r.tokens[len(r.prompt):] for r in res.rows]
        for key, src in (("drafts", "spec_decode_num_drafts"),
                         ("draft_tokens", "spec_decode_num_draft_tokens"),
                         ("accepted", "spec_decode_num_accepted_tokens"),
                         ("target_calls", "target_calls"), ("draft_calls", "draft_calls"),
                         ("target_s", "target_time_s"), ("draft_s", "draft_time_s"),
                         ("e2e_s", "e2e_s"), ("prefill_s", "ttft_s"),
                         ("host_s", "host_overhead_s"), ("new_tokens", "new_tokens"),
                         ("rows", "requests")):
            t[key] += st[src]
        t["prefill_calls"] += prefill_calls(chunk, prefill, ctx_len)
        for j, a in enumerate(st["spec_decode_num_accepted_tokens_per_pos"]):
            if j >= len(t["per_pos"]):
                t["per_pos"].append(0)
            t["per_pos"][j] += a
    t["steps"] = max(1, t["target_calls"] - t["prefill_calls"])
    t["host_per_step"] = t["host_s"] / t["steps"]
    decode_s = t["e2e_s"] - t["prefill_s"]
    t["decode_tokens_per_s"] = (t["new_tokens"] - t["rows"]) / decode_s if decode_s > 0 else None
    return t


def replayed(gen, prompt_ids: list[list[int]], outputs: list[list[int]], max_new_tokens: int,
             k: int, draft_p_min: float = 0.0) -> dict[str, Any]:
    """Statistics of `gen`'s method at K over the prompt set, replayed by the engine (a fresh
    proposer for the set, requests in order, as a real run from a fresh proposer), with the
    draft's confidence stop at `draft_p_min`."""
    g = gen.sibling(gen.method)
    g.decoder.draft_p_min = draft_p_min
    rows, times = replay(g.decoder, prompt_ids, outputs, max_new_tokens, k)
    st = summarize(rows, times, gen.method)
    per_pos = list(st["spec_decode_num_accepted_tokens_per_pos"])
    per_pos += [0] * (k - len(per_pos))
    steps = sum(r.stats.target_calls for r in rows)  # verify steps (prefill not counted)
    drafts = st["spec_decode_num_drafts"]
    return {"k": k, "steps": steps, "drafts": drafts,
            "draft_tokens": st["spec_decode_num_draft_tokens"],
            "accepted": st["spec_decode_num_accepted_tokens"], "per_pos": per_pos,
            "draft_calls": times.draft_calls, "tokens": st["new_tokens"] - len(rows),
            "alpha": conditional_acceptance(per_pos, drafts),
            "windows": dict(times.windows),
            "proposal_fraction": drafts / steps if steps else 0.0}

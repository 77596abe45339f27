"""Acceptance evidence for `qpcbuild tune`: greedy runs summed over a prompt set, and the
engine's own loop replayed over the target's greedy outputs at every K (`runtime.replay.replay`:
the real proposer or draft, the real acceptance and statistics; only the target is read off the
known outputs). Per-position acceptance depends on K (acceptance comes in runs, and a larger K
spends fewer steps on a run, so the steps it takes start more often where the proposer
disagrees), which is why each K is replayed rather than extrapolated."""

from __future__ import annotations

from typing import Any

from ..runtime.policy import ConfidenceStop
from ..runtime.replay import replay
from ..runtime.rows import prefill_calls
from ..runtime.stats import SpecDecodingStats
from .model import conditional_acceptance


def summed_run(gen, ids: list[list[int]], max_new_tokens: int, k: int | None,
         target_only: bool = False) -> dict[str, Any]:
    """Greedy generation over `ids` in batches; summed statistics."""
    batch, prefill = gen.target.batch_size, gen.manifest.shapes.prefill_seq_len
    records, outputs, prefills = [], [], 0
    for start in range(0, len(ids), batch):
        chunk = ids[start:start + batch]
        res = gen.generate(chunk, max_new_tokens, k=k, target_only=target_only)
        records.append(res.stats)
        outputs += [r.tokens[len(r.prompt):] for r in res.rows]
        prefills += prefill_calls(chunk, prefill)
    st = SpecDecodingStats.merged(records)
    steps = max(1, st.target_calls - prefills)
    return {"drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens,
            "accepted": st.num_accepted_tokens, "target_calls": st.target_calls,
            "draft_calls": st.draft_calls, "target_s": st.target_s, "draft_s": st.draft_s,
            "e2e_s": st.total_s, "prefill_s": st.prefill_s, "host_s": st.host_overhead_s,
            "new_tokens": st.new_tokens, "rows": st.requests, "prefill_calls": prefills,
            "per_pos": list(st.accepted_per_pos), "outputs": outputs, "steps": steps,
            "host_per_step": st.host_overhead_s / steps,
            "decode_tokens_per_s": st.decode_tokens_per_s if st.decode_s > 0 else None}


def replayed(gen, prompt_ids: list[list[int]], outputs: list[list[int]], max_new_tokens: int,
             k: int, draft_p_min: float = 0.0) -> dict[str, Any]:
    """Statistics of `gen`'s method at K over the prompt set, replayed by the engine (a fresh
    proposer for the set, requests in order, as a real run from a fresh proposer), with the
    draft's confidence stop at `draft_p_min`."""
    g = gen.sibling(gen.method)
    g.decoder.confidence_stop = ConfidenceStop(draft_p_min)
    rows, times = replay(g.decoder, prompt_ids, outputs, max_new_tokens, k)
    st = SpecDecodingStats.from_rows(rows, times, gen.method)
    per_pos = list(st.accepted_per_pos)
    per_pos += [0] * (k - len(per_pos))
    steps = sum(r.stats.target_calls for r in rows)  # verify steps (prefill not counted)
    drafts = st.num_drafts
    return {"k": k, "steps": steps, "drafts": drafts, "draft_tokens": st.num_draft_tokens,
            "accepted": st.num_accepted_tokens, "per_pos": per_pos,
            "acceptance_rate": st.acceptance_rate,
            "draft_calls": times.draft_calls, "tokens": st.new_tokens - len(rows),
            "alpha": conditional_acceptance(per_pos, drafts),
            "windows": dict(times.windows),
            "proposal_fraction": drafts / steps if steps else 0.0}

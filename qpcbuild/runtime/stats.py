"""Acceptance and speed statistics, under vLLM's metric names where they exist."""

from __future__ import annotations

from typing import Any

from .rows import LoopTimes, Row


def summarize(rows: list[Row], times: LoopTimes, method: str) -> dict[str, Any]:
    drafts = sum(r.stats.num_drafts for r in rows)
    draft_tokens = sum(r.stats.num_draft_tokens for r in rows)
    accepted = sum(r.stats.num_accepted_tokens for r in rows)
    width = max((len(r.stats.accepted_per_pos) for r in rows), default=0)
    per_pos = [sum(r.stats.accepted_per_pos[j] for r in rows if j < len(r.stats.accepted_per_pos))
               for j in range(width)]
    new_tokens = sum(r.stats.new_tokens for r in rows)
    decode_s = max(times.total_s - times.prefill_s, 1e-9)
    model_s = times.draft_s + times.target_s
    return {
        "method": method,
        "requests": len(rows),
        "new_tokens": new_tokens,
        "ttft_s": round(times.prefill_s, 4),
        "e2e_s": round(times.total_s, 4),
        "decode_tokens_per_s": round(max(new_tokens - len(rows), 0) / decode_s, 2),
        "e2e_tokens_per_s": round(new_tokens / max(times.total_s, 1e-9), 2),
        "draft_time_s": round(times.draft_s, 4),
        "target_time_s": round(times.target_s, 4),
        "host_overhead_s": round(times.total_s - model_s, 4),
        "host_overhead_fraction": round((times.total_s - model_s) / max(times.total_s, 1e-9), 4),
        "target_calls": times.target_calls,
        "draft_calls": times.draft_calls,
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        # the goodput gate (docs/adaptive.md): steps with and without speculation, switches
        **({"speculation": times.gate} if times.gate else {}),
        "verify_windows": {str(k): n for k, n in sorted(times.windows.items())},
        "draft_catch_up_calls": times.catch_up_calls,
        "per_request": [{"prompt_tokens": r.stats.prompt_tokens, "new_tokens": r.stats.new_tokens,
                         "finish_reason": r.finish_reason, "ttft_s": round(r.stats.ttft_s, 4),
                         "e2e_s": round(r.stats.e2e_s, 4),
                         "spec_decode_num_drafts": r.stats.num_drafts,
                         "spec_decode_num_draft_tokens": r.stats.num_draft_tokens,
                         "spec_decode_num_accepted_tokens": r.stats.num_accepted_tokens,
                         "acceptance_rate": round(r.stats.acceptance_rate, 4),
                         "mean_acceptance_length": round(r.stats.mean_acceptance_length, 4),
                         "steps_with_speculation": r.stats.spec_steps,
                         "steps_without_speculation": r.stats.plain_steps}
                        for r in rows],
    }


def combine(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The statistics of several batches (as `summarize` returned them) as of one run: counts
    and times add up, rates are recomputed from the sums, time to first token is the mean."""
    def total(key: str) -> float:
        return sum(b[key] for b in batches)

    new_tokens, requests, e2e = total("new_tokens"), total("requests"), total("e2e_s")
    decode_s = max(e2e - total("ttft_s"), 1e-9)
    drafts, draft_tokens = total("spec_decode_num_drafts"), total("spec_decode_num_draft_tokens")
    accepted = total("spec_decode_num_accepted_tokens")
    width = max((len(b["spec_decode_num_accepted_tokens_per_pos"]) for b in batches), default=0)
    return {
        "requests": requests, "new_tokens": new_tokens,
        "ttft_s": round(total("ttft_s") / len(batches), 4), "e2e_s": round(e2e, 4),
        "decode_tokens_per_s": round(sum(max(b["new_tokens"] - b["requests"], 0)
                                         for b in batches) / decode_s, 2),
        "e2e_tokens_per_s": round(new_tokens / max(e2e, 1e-9), 2),
        "draft_time_s": round(total("draft_time_s"), 4),
        "target_time_s": round(total("target_time_s"), 4),
        "host_overhead_s": round(total("host_overhead_s"), 4),
        "host_overhead_fraction": round(total("host_overhead_s") / max(e2e, 1e-9), 4),
        "target_calls": total("target_calls"), "draft_calls": total("draft_calls"),
        "spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_num_accepted_tokens_per_pos": [
            sum(b["spec_decode_num_accepted_tokens_per_pos"][j] for b in batches
                if j < len(b["spec_decode_num_accepted_tokens_per_pos"])) for j in range(width)],
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
    }

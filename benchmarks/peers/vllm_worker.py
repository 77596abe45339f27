"""One vLLM engine for `qpcbuild bench`'s "vllm" peer, run by the vLLM environment's own Python
(vLLM is not a dependency of qpcbuild and lives in its own venv): this file imports only the
standard library and vllm, never qpcbuild.

    python vllm_worker.py --version
    python vllm_worker.py CONFIG.json     # then one JSON request per stdin line

CONFIG: {"model", "max_model_len", "speculative_config" (or null)}. A request
{"prompts": [[token ids], ...], "max_new": N} is answered, each prompt alone (batch 1, greedy),
by {"outputs": [[ids]], "tokens": n, "seconds": s, "drafts": d, "draft_tokens": t,
"accepted": a} on a line starting with REPLY (vLLM logs on stdout too)."""

from __future__ import annotations

import json
import sys
import time

REPLY = "@@qpcbuild-vllm "
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}


def _say(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _counters(llm) -> dict:
    out = {v: 0 for v in SPEC_COUNTERS.values()}
    try:
        metrics = llm.get_metrics()
    except Exception:
        return out
    for m in metrics:
        key = SPEC_COUNTERS.get(getattr(m, "name", ""))
        if key is not None and hasattr(m, "value"):
            out[key] += int(m.value)
    return out


def main() -> int:
    import vllm

    if sys.argv[1:] == ["--version"]:
        _say({"vllm": vllm.__version__})
        return 0
    cfg = json.loads(open(sys.argv[1]).read())
    llm = vllm.LLM(model=cfg["model"], dtype="float32", max_model_len=cfg["max_model_len"],
                   enforce_eager=True, seed=0, speculative_config=cfg["speculative_config"],
                   disable_log_stats=False)
    _say({"ready": True, "vllm": vllm.__version__})
    params_for = {}
    for line in sys.stdin:
        req = json.loads(line)
        n = int(req["max_new"])
        if n not in params_for:
            params_for[n] = vllm.SamplingParams(temperature=0.0, max_tokens=n)
        before = _counters(llm)
        outs, tokens, seconds = [], 0, 0.0
        for ids in req["prompts"]:
            t0 = time.perf_counter()
            res = llm.generate([vllm.TokensPrompt(prompt_token_ids=ids)], params_for[n],
                               use_tqdm=False)
            seconds += time.perf_counter() - t0
            new = list(res[0].outputs[0].token_ids)
            outs.append(new)
            tokens += len(new)
        after = _counters(llm)
        _say({"outputs": outs, "tokens": tokens, "seconds": seconds,
              **{k: after[k] - before[k] for k in after}})
    return 0


if __name__ == "__main__":  # vLLM's CPU backend spawns processes: this guard is required
    sys.exit(main())

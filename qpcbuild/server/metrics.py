"""Prometheus metrics under vLLM's names, so the dashboards and alerts written for vLLM on the
card (e.g. on vllm:spec_decode_draft_acceptance_rate) read this server unchanged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from ..runtime.disagg import DisaggDecoder, HandoffRecord, PrefillWorker
from ..runtime.loader import Generator
from ..runtime.rates import acceptance_rate

# The KV hand-off's bytes per request: a few KiB (a short prompt on a small model) to GiBs
BYTE_BUCKETS = tuple(float(4 ** n * 1024) for n in range(13))  # 1 KiB .. 16 GiB
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class ServerMetrics:
    def __init__(self, model_name: str, running, waiting):
        disable_created_metrics()  # as vLLM: no *_created series next to each counter
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=r)

        self.num_drafts = counter("vllm:spec_decode_num_drafts",
                                  "Verify steps that carried at least one proposed token.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                        "Proposed tokens.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                           "Accepted proposed tokens.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted proposed tokens by position in the proposal.",
                                        ["position"])
        self.acceptance_rate = Gauge("vllm:spec_decode_draft_acceptance_rate",
                                     "Accepted / proposed tokens since the server started.",
                                     labels, registry=r)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.request_success = counter("vllm:request_success", "Finished requests.",
                                       ["finished_reason"])
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Mean time per output token after the first, per request.",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_hist = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                     labels, buckets=TOKEN_BUCKETS, registry=r)
        self.gen_hist = Histogram("vllm:request_generation_tokens",
                                  "Generated tokens per request.", labels,
                                  buckets=TOKEN_BUCKETS, registry=r)
        # the goodput gate (docs/adaptive.md); not vLLM metrics, so under qpcbuild's own names
        self.spec_steps = counter("qpcbuild:spec_decode_steps", "Verify steps with and without "
                                  "speculation.", ["speculation"])
        self.policy_switches = counter("qpcbuild:spec_decode_policy_switches",
                                       "Times the goodput gate turned speculation on or off.",
                                       ["to"])
        self._switches_seen = 0
        Gauge("vllm:num_requests_running", "Requests being decoded.", labels,
              registry=r).labels(model_name).set_function(running)
        Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", labels,
              registry=r).labels(model_name).set_function(waiting)
        self._drafted = self._accepted = self._drafts = 0

    def acceptance(self) -> tuple[float | None, float | None]:
        """(accepted / proposed tokens, mean acceptance length = 1 + accepted per verify step
        with a proposal, vLLM's definition) over the finished requests; None before any."""
        rate = acceptance_rate(self._accepted, self._drafted)
        return rate, (1 + self._accepted / self._drafts) if self._drafts else None

    def record_switches(self, switches: list[dict]) -> None:
        """The gate's switches so far (all of them, in order, possibly still growing in the
        engine's thread); counts the new ones."""
        new = switches[self._switches_seen:]
        for s in new:
            self.policy_switches.labels(self.model, "on" if s["to"] == "spec" else "off").inc()
        self._switches_seen += len(new)

    def record(self, row) -> None:
        """A finished request: its prompt, its tokens, its latencies and its speculation."""
        m, st = self.model, row.stats
        self.spec_steps.labels(m, "on").inc(st.spec_steps)
        self.spec_steps.labels(m, "off").inc(st.plain_steps)
        self.num_drafts.labels(m).inc(st.num_drafts)
        self.num_draft_tokens.labels(m).inc(st.num_draft_tokens)
        self.num_accepted_tokens.labels(m).inc(st.num_accepted_tokens)
        for pos, n in enumerate(st.accepted_per_pos):
            self.accepted_per_pos.labels(m, str(pos)).inc(n)
        self._drafted += st.num_draft_tokens
        self._drafts += st.num_drafts
        self._accepted += st.num_accepted_tokens
        rate = acceptance_rate(self._accepted, self._drafted)
        if rate is not None:
            self.acceptance_rate.labels(m).set(rate)
        self.prompt_tokens.labels(m).inc(st.prompt_tokens)
        self.generation_tokens.labels(m).inc(st.new_tokens)
        self.request_success.labels(m, openai_finish_reason(row.finish_reason)).inc()
        if st.new_tokens:
            self.ttft.labels(m).observe(st.ttft_s)
        self.e2e.labels(m).observe(st.e2e_s)
        if st.new_tokens > 1:
            self.itl.labels(m).observe((st.e2e_s - st.ttft_s) / (st.new_tokens - 1))
        self.prompt_hist.labels(m).observe(st.prompt_tokens)
        self.gen_hist.labels(m).observe(st.new_tokens)


def openai_finish_reason(reason: str) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length", "ctx_len": "length",
            "abort": "abort"}.get(reason, reason or "stop")


class HandoffMetrics:
    """A disaggregated bundle's KV hand-off and its prefill worker, beside vLLM's metrics
    (qpcbuild's own names: vLLM has none for them). Each request's record is counted as the
    decode node takes its KV, on the engine's thread."""

    def __init__(self, metrics: ServerMetrics, worker: PrefillWorker):
        r, labels, self.model = metrics.registry, ["model_name"], metrics.model
        self.bytes = Counter("qpcbuild:kv_handoff_bytes", "KV bytes handed from the prefill "
                             "worker to the decode node.", labels, registry=r)
        self.requests = Counter("qpcbuild:kv_handoff_requests", "Requests whose KV was handed "
                                "off.", labels, registry=r)
        self.seconds = Histogram("qpcbuild:kv_handoff_seconds", "Seconds the hand-off added "
                                 "per request (round trip less the worker's prefill).", labels,
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("qpcbuild:kv_handoff_prefill_seconds", "The prefill worker's "
                                 "compute per request.", labels, buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.size = Histogram("qpcbuild:kv_handoff_request_bytes", "KV bytes per request.",
                              labels, buckets=BYTE_BUCKETS, registry=r)
        Gauge("qpcbuild:prefill_worker_restarts", "Prefill workers started in place of a dead "
              "or hung one.", labels, registry=r).labels(self.model).set_function(
                  lambda: worker.restarts)
        Gauge("qpcbuild:prefill_worker_up", "1 while a prefill worker can take requests.",
              labels, registry=r).labels(self.model).set_function(
                  lambda: float(worker.unavailable() is None))

    def record(self, h: HandoffRecord) -> None:
        m = self.model
        self.bytes.labels(m).inc(h.bytes)
        self.requests.labels(m).inc()
        self.seconds.labels(m).observe(h.seconds)
        self.prefill.labels(m).observe(h.prefill_s)
        self.size.labels(m).observe(h.bytes)


def serve_disaggregated(gen: Generator, metrics: ServerMetrics) -> PrefillWorker | None:
    """A disaggregated bundle's prefill worker under a server (None for other bundles): it
    is replaced in the background when it dies or hangs, and its requests meanwhile get 503
    (runtime/disagg.py); its hand-offs are counted, not kept."""
    worker, decoder = gen.prefill_worker, gen.decoder
    if worker is None or not isinstance(decoder, DisaggDecoder):
        return None
    worker.serving = True
    decoder.log.keep = False  # a long-lived server would keep one record per request
    decoder.log.on_record = HandoffMetrics(metrics, worker).record
    return worker

"""`GET /metrics`: the server's figures in Prometheus' text format (the `prometheus-client` package).

Names follow llama-server's and vLLM's where they have one, under a `localspec:` prefix, so dashboards built for
them read these: `localspec:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}` (counters get `_total` in the
exposition, as vLLM's do), the drafts, drafted and accepted tokens of each drafting source
(`..._num_drafts_by_drafter_total{drafter}`, `..._num_draft_tokens_by_drafter_total{drafter}`,
`..._num_accepted_tokens_by_drafter_total{drafter}`; drafter: lookup, ngram, suffix, draft or a head's kind), request outcomes, the queue, time to first token and inter-token latency. Each app has its
own registry (several apps may live in one process: the tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

P = "localspec:"
# client_error: refused for what the request asked (a prompt longer than the context, a logit_bias that bans every
# token), before or as its generation starts, not a failure of the server
OUTCOMES = ("completed", "cancelled", "failed", "rejected", "client_error")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    """The collectors of one app. The worker counts outcomes in `requests` and calls `token` and `request_done`; the gauges read the
    worker when scraped."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, worker=None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(P + "requests", "Generation requests by outcome.", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(outcome=o)  # every outcome shows from the start, at 0
        self.queue = Gauge(P + "num_requests_waiting", "Requests queued, not started.", registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests generating now (at most the slots).", registry=r)
        self.slots = Gauge(P + "num_slots", "Requests that may be decoded together (serve --parallel).",
                           registry=r)
        self.slots_active = Gauge(P + "num_slots_active", "Slots generating now.", registry=r)
        if worker is not None:
            self.queue.set_function(lambda: worker.waiting)
            self.running.set_function(lambda: worker.active)
            self.slots.set_function(lambda: worker.parallel)
            self.slots_active.set_function(lambda: worker.active)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between emitted tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Generation time of finished requests.",
                             buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed (cached ones included).",
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Target passes that verified drafted tokens.",
                                  registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Tokens drafted.", registry=r)
        self.num_accepted_tokens = Counter(P + "spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
                                           registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted, by position in the draft (0 = first).",
                                        ["position"], registry=r)
        self.drafted_per_pos = Counter(P + "spec_decode_num_draft_tokens_per_pos",
                                       "Tokens drafted, by position in the draft (0 = first).", ["position"],
                                       registry=r)
        # the same figures per drafting source (lookup, ngram, suffix, draft, a head): which one drafted and what it got
        self.drafts_by = Counter(P + "spec_decode_num_drafts_by_drafter",
                                 "Target passes that verified drafted tokens, by the drafter that drafted them.",
                                 ["drafter"], registry=r)
        self.draft_tokens_by = Counter(P + "spec_decode_num_draft_tokens_by_drafter", "Tokens drafted, by drafter.",
                                       ["drafter"], registry=r)
        self.accepted_tokens_by = Counter(P + "spec_decode_num_accepted_tokens_by_drafter",
                                          "Drafted tokens accepted, by drafter.", ["drafter"], registry=r)
        info = Gauge(P + "model_info", "The served model (value 1).", ["model"], registry=r)
        info.labels(model=model).set(1)

    # ------------------------------------------------------------ called by the worker thread
    def token(self, gap_s: float | None) -> None:
        """One emitted token; `gap_s`: the time since the previous one of the same request (None for the first)."""
        if gap_s is not None:
            self.itl.observe(max(0.0, gap_s))

    def request_done(self, fin) -> None:
        """A generation ended (Finished): its outcome and the figures of its Stats."""
        st = fin.stats
        self.requests.labels(outcome="cancelled" if fin.finish_reason == "cancelled" else "completed").inc()
        if st.completion_tokens:
            self.ttft.observe(st.ttft_s)
        self.e2e.observe(st.elapsed_s)
        self.prompt_tokens.inc(st.prompt_tokens)
        self.generation_tokens.inc(st.completion_tokens)
        self.num_drafts.inc(st.drafting_steps)
        self.num_draft_tokens.inc(st.drafted)
        self.num_accepted_tokens.inc(st.accepted)
        for pos, n in enumerate(st.drafted_at):
            self.drafted_per_pos.labels(position=str(pos)).inc(n)
        for pos, n in enumerate(st.accepted_at):
            self.accepted_per_pos.labels(position=str(pos)).inc(n)
        for name, (steps, drafted, accepted) in st.by_source().items():
            self.drafts_by.labels(drafter=name).inc(steps)
            if drafted is not None:  # None: the request's split among its drafters was not recorded
                self.draft_tokens_by.labels(drafter=name).inc(drafted)
                self.accepted_tokens_by.labels(drafter=name).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)

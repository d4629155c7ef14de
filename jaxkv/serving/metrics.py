"""The server's Prometheus metrics, under vLLM's names and types where the quantity is
the same (a dashboard built for `vllm serve` reads them unchanged), jaxkv's own under
`jaxkv:`.

Per-step figures (`observe_step`) come from each step's `StepStats`, as the engine
reports them; per-request latencies (`RequestTimer`) from the handler that streams
the request. Each server has its own registry, so several can live in one process.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "RequestTimer", "ServerMetrics"]

# vLLM's buckets for these histograms (seconds).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class ServerMetrics:
    """The metrics of one served model (label `model_name`)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def make(kind, name: str, doc: str, **kw):
            return kind(name, doc, labels, registry=self.registry, **kw).labels(model_name)

        self.running = make(Gauge, "vllm:num_requests_running", "Requests in the batch.")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Requests waiting.")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).")
        self.prefix_queries = make(
            Counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = make(
            Counter, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.preemptions = make(Counter, "vllm:num_preemptions", "Preemptions.")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.ttft = make(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Time to the first token.",
            buckets=_TTFT_BUCKETS,
        )
        self.itl = make(
            Histogram,
            "vllm:inter_token_latency_seconds",
            "Time between tokens.",
            buckets=_ITL_BUCKETS,
        )
        self.e2e = make(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to the last token.",
            buckets=_E2E_BUCKETS,
        )
        self.host_hits = make(
            Counter, "jaxkv:host_tier_hit_tokens", "Prompt tokens served by the host KV tier."
        )
        self.encoder_hits = make(Counter, "jaxkv:encoder_cache_hits", "Encoder-cache hits.")
        self.encoder_queries = make(
            Counter, "jaxkv:encoder_cache_queries", "Encoder-cache lookups."
        )

    def observe_step(self, step) -> None:
        """One engine step's `StepStats`."""
        self.running.set(step.num_running)
        self.waiting.set(step.num_waiting + step.num_loading)
        self.kv_usage.set(step.kv_usage)
        self.prefix_queries.inc(step.prefix_queries)
        self.prefix_hits.inc(step.prefix_hits)
        self.preemptions.inc(step.num_preemptions)
        self.generation_tokens.inc(step.num_generated_tokens)
        self.host_hits.inc(step.host_hit_tokens)
        self.encoder_hits.inc(step.encoder_hits)
        self.encoder_queries.inc(step.encoder_hits + step.encoder_misses)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies as its outputs arrive (monotonic times)."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompt_tokens: int) -> None:
        self.metrics, self.arrival, self.last = metrics, arrival, None
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def tokens(self, at: float, count: int) -> None:
        """`count` new tokens arrived at `at`."""
        if count <= 0:
            return
        if self.last is None:
            self.metrics.ttft.observe(at - self.arrival)
        else:
            self.metrics.itl.observe((at - self.last) / count)
        self.last = at

    def finished(self, at: float | None = None) -> None:
        self.metrics.e2e.observe((time.monotonic() if at is None else at) - self.arrival)

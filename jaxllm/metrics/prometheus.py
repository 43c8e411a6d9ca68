"""Prometheus collectors with vLLM's metric names under `jaxllm:`, labelled by model and engine.

The collectors are made once per registry; each engine core gets its own label children
(`engine="0"`, `"1"`, ...), so data-parallel replicas behind one server export side by side.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from jaxllm.metrics.stats import IterationStats

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class Collectors:
    def __init__(self, registry: CollectorRegistry):
        def gauge(name, doc):
            return Gauge(f"jaxllm:{name}", doc, LABELS, registry=registry)

        def counter(name, doc, extra=()):
            return Counter(f"jaxllm:{name}", doc, LABELS + extra, registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(f"jaxllm:{name}", doc, LABELS, buckets=buckets, registry=registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        # prometheus_client appends `_total` to counter names itself
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self.preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens the prefix cache supplied.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS)


_collectors: dict[int, Collectors] = {}


def collectors(registry: CollectorRegistry = REGISTRY) -> Collectors:
    if id(registry) not in _collectors:
        _collectors[id(registry)] = Collectors(registry)
    return _collectors[id(registry)]


class PrometheusStatLogger:
    """Feeds one engine core's numbers into the collectors, under its `engine` label."""

    def __init__(self, model_name: str, engine_index: int = 0, registry: CollectorRegistry = REGISTRY):
        c = collectors(registry)
        labels = {"model_name": model_name, "engine": str(engine_index)}
        self.running, self.waiting, self.kv_usage = (g.labels(**labels) for g in (c.running, c.waiting, c.kv_usage))
        self.prompt_tokens = c.prompt_tokens.labels(**labels)
        self.generation_tokens = c.generation_tokens.labels(**labels)
        self.success = {r: c.success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}
        self.preemptions = c.preemptions.labels(**labels)
        self.prefix_queries = c.prefix_queries.labels(**labels)
        self.prefix_hits = c.prefix_hits.labels(**labels)
        self.ttft, self.itl, self.e2e, self.queue, self.prefill, self.decode = (
            h.labels(**labels) for h in (c.ttft, c.itl, c.e2e, c.queue, c.prefill, c.decode)
        )
        self._engine_totals = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def record_engine(self, stats: dict) -> None:
        """Gauges from the core's latest snapshot; its running totals become counter increments."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        for key, counter in (
            ("num_preemptions", self.preemptions),
            ("prefix_cache_queries", self.prefix_queries),
            ("prefix_cache_hits", self.prefix_hits),
        ):
            delta = stats[key] - self._engine_totals[key]
            if delta > 0:
                counter.inc(delta)
            self._engine_totals[key] = stats[key]

    def record_iteration(self, it: IterationStats) -> None:
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
        for f in it.finished:
            self.success.get(f.finish_reason, self.success["error"]).inc()
            self.e2e.observe(f.e2e_latency)
            self.queue.observe(f.queue_time)
            self.prefill.observe(f.prefill_time)
            self.decode.observe(f.decode_time)

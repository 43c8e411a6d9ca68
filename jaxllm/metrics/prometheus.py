"""Prometheus collectors with vLLM's metric names under `jaxllm:`, labelled by model and engine.

The collectors are made once per registry; each engine core gets its own label children
(`engine="0"`, `"1"`, ...), so data-parallel replicas behind one server export side by side.
Speculative decoding's counters exist only once an engine with speculation reports (as vLLM's,
which registers them only when `speculative_config` is set).
"""

from __future__ import annotations

import weakref

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


class SpecDecodeCollectors:
    """vLLM's speculative-decoding counters; `accepted_per_pos` has a `position` label (0 = the first draft)."""

    def __init__(self, registry: CollectorRegistry):
        def counter(name, doc, extra=()):
            return Counter(f"jaxllm:{name}", doc, LABELS + extra, registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Verifications of at least one draft token.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.", ("position",)
        )
        # jaxllm's own: decode steps of requests that may not speculate (repetition/frequency/presence penalties)
        self.unspeculated = counter(
            "spec_decode_num_unspeculated", "Decode steps of requests that may not speculate (penalties)."
        )


class ExpertCollectors:
    """A mixture of experts' routing: tokens routed to each expert of each sparse layer, and each layer's load
    imbalance (the busiest expert's tokens over the mean, since start: 1 is perfectly even)."""

    def __init__(self, registry: CollectorRegistry):
        self.tokens = Counter(
            "jaxllm:moe_expert_tokens", "Tokens routed to each expert.", LABELS + ("layer", "expert"), registry=registry
        )
        self.imbalance = Gauge(
            "jaxllm:moe_expert_load_imbalance",
            "The busiest expert's tokens over the mean, per layer, since start.",
            LABELS + ("layer",),
            registry=registry,
        )


KV_TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class KVTransferCollectors:
    """A KV connector's counters (vLLM's external prefix cache names; transfers by direction: load, save, send,
    receive), registered once an engine with a connector reports."""

    def __init__(self, registry: CollectorRegistry):
        def counter(name, doc, extra=()):
            return Counter(f"jaxllm:{name}", doc, LABELS + extra, registry=registry)

        self.queries = counter("external_prefix_cache_queries", "Tokens looked up outside the device KV cache.")
        self.hits = counter("external_prefix_cache_hits", "Tokens whose KV was loaded from outside the device cache.")
        self.bytes = counter("kv_transfer_bytes", "Bytes of KV moved by the KV connector.", ("direction",))
        self.transfers = counter("kv_transfer_count", "KV transfers done by the KV connector.", ("direction",))
        self.failures = counter("kv_transfer_failures", "KV loads that failed, by reason.", ("reason",))
        self.seconds = Histogram(
            "jaxllm:kv_transfer_seconds",
            "Seconds per KV transfer.",
            LABELS + ("direction",),
            buckets=KV_TRANSFER_BUCKETS,
            registry=registry,
        )


LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


class Collectors:
    def __init__(self, registry: CollectorRegistry):
        self._registry = registry
        self._lora_info: Gauge | None = None
        self._spec: SpecDecodeCollectors | None = None
        self._kv_transfer: KVTransferCollectors | None = None
        self._experts: ExpertCollectors | None = None

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

    @property
    def kv_transfer(self) -> KVTransferCollectors:
        """The KV connector's counters, registered on first use."""
        if self._kv_transfer is None:
            self._kv_transfer = KVTransferCollectors(self._registry)
        return self._kv_transfer

    @property
    def lora_info(self) -> Gauge:
        """vLLM's lora_requests_info: the adapters of the running and waiting requests (comma-joined names) as
        labels, the time they were seen as the value; registered once an engine with LoRA reports."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                "jaxllm:lora_requests_info",
                "Running stats on lora requests.",
                LABELS + LORA_LABELS,
                registry=self._registry,
            )
        return self._lora_info

    @property
    def experts(self) -> ExpertCollectors:
        """A mixture of experts' routing counters, registered on first use."""
        if self._experts is None:
            self._experts = ExpertCollectors(self._registry)
        return self._experts

    @property
    def spec(self) -> SpecDecodeCollectors:
        """The speculative-decoding counters, registered on first use."""
        if self._spec is None:
            self._spec = SpecDecodeCollectors(self._registry)
        return self._spec


# by the registry itself, not its id: an `LLM`'s private registry may be collected and its id reused
_collectors: weakref.WeakKeyDictionary[CollectorRegistry, Collectors] = weakref.WeakKeyDictionary()


def collectors(registry: CollectorRegistry = REGISTRY) -> Collectors:
    if registry not in _collectors:
        _collectors[registry] = Collectors(registry)
    return _collectors[registry]


class PrometheusStatLogger:
    """Feeds one engine core's numbers into the collectors, under its `engine` label."""

    def __init__(self, model_name: str, engine_index: int = 0, registry: CollectorRegistry = REGISTRY):
        c = self._collectors = collectors(registry)
        labels = self._labels = {"model_name": model_name, "engine": str(engine_index)}
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
        self._spec: dict | None = None  # the spec_decode counters' children, once the engine reports speculation
        self._spec_per_pos: list = []
        self._spec_totals: dict = {}
        self._kv_totals: dict = {}  # the KV connector's running totals as last seen, by counter key
        self._expert_totals: dict = {}  # (layer, expert) → tokens routed, as last seen

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
        if "spec_decode_num_drafts" in stats:  # EngineCore.stats() has the spec_decode totals only when speculating
            self._record_spec(stats)
        if "external_prefix_cache_queries" in stats:  # ... and a KV connector's only with one
            self._record_kv_transfer(stats)
        if "moe_expert_tokens" in stats:  # ... and a mixture of experts' routing only for one
            self._record_experts(stats["moe_expert_tokens"])
        if "lora" in stats:  # ... and the adapters in use only with LoRA on
            lora = stats["lora"]
            self._collectors.lora_info.labels(
                **self._labels,
                max_lora=str(lora["max_loras"]),
                waiting_lora_adapters=",".join(lora["waiting"]),
                running_lora_adapters=",".join(lora["running"]),
            ).set_to_current_time()

    def _record_experts(self, tokens: dict[int, list[int]]) -> None:
        """Each expert's routed tokens (running totals) as counter increments; each layer's imbalance."""
        c = self._collectors.experts
        for layer, counts in tokens.items():
            for expert, total in enumerate(counts):  # every expert's child, idle ones at 0
                child = c.tokens.labels(**self._labels, layer=str(layer), expert=str(expert))
                seen = self._expert_totals.get((layer, expert), 0)
                if total > seen:
                    child.inc(total - seen)
                    self._expert_totals[layer, expert] = total
            if sum(counts):
                imbalance = max(counts) * len(counts) / sum(counts)
                c.imbalance.labels(**self._labels, layer=str(layer)).set(imbalance)

    def _record_kv_transfer(self, stats: dict) -> None:
        """The KV connector's counters from the core's running totals, as increments; its latencies as given."""
        c = self._collectors.kv_transfer
        totals = {
            ("queries", ""): stats["external_prefix_cache_queries"],
            ("hits", ""): stats["external_prefix_cache_hits"],
        }
        for key, value in stats.items():
            if key.startswith("kv_transfer_") and key.endswith(("_bytes", "_count")):
                direction, kind = key[len("kv_transfer_") :].rsplit("_", 1)
                totals["bytes" if kind == "bytes" else "transfers", direction] = value
        for reason, value in stats.get("kv_transfer_failures", {}).items():
            totals["failures", reason] = value
        for (name, label), value in totals.items():
            delta = value - self._kv_totals.get((name, label), 0)
            if delta > 0:
                counter = getattr(c, name)
                if name in ("bytes", "transfers"):
                    counter = counter.labels(**self._labels, direction=label)
                elif name == "failures":
                    counter = counter.labels(**self._labels, reason=label)
                else:
                    counter = counter.labels(**self._labels)
                counter.inc(delta)
            self._kv_totals[name, label] = value
        for direction, seconds in stats.get("kv_transfer_seconds", {}).items():
            child = c.seconds.labels(**self._labels, direction=direction)
            for t in seconds:
                child.observe(t)

    def _record_spec(self, stats: dict) -> None:
        """The speculation counters from the core's running totals (`EngineCore.stats()`), as increments."""
        if self._spec is None:
            c = self._collectors.spec
            self._spec = {
                "spec_decode_num_drafts": c.drafts.labels(**self._labels),
                "spec_decode_num_draft_tokens": c.draft_tokens.labels(**self._labels),
                "spec_decode_num_accepted_tokens": c.accepted_tokens.labels(**self._labels),
                "spec_decode_num_unspeculated": c.unspeculated.labels(**self._labels),
            }
            self._spec_totals = dict.fromkeys(self._spec, 0)
        for key, counter in self._spec.items():
            delta = stats.get(key, 0) - self._spec_totals[key]
            if delta > 0:
                counter.inc(delta)
            self._spec_totals[key] = stats.get(key, 0)
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos", [])
        while len(self._spec_per_pos) < len(per_pos):  # one child per position, made at the first report
            child = self._collectors.spec.accepted_per_pos.labels(**self._labels, position=str(len(self._spec_per_pos)))
            self._spec_per_pos.append([child, 0])
        for entry, total in zip(self._spec_per_pos, per_pos, strict=False):
            if total > entry[1]:
                entry[0].inc(total - entry[1])
            entry[1] = total

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

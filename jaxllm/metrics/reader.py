"""The metrics as Python objects (vLLM's `vllm.v1.metrics.reader`): what `LLM.get_metrics()` returns.

Every `jaxllm:` collector of a Prometheus registry becomes one object per label set, named as on
`/metrics` without the `_total` suffix Prometheus adds to counters:

- `Gauge(name, labels, value)` and `Counter(name, labels, value)`;
- `Vector(name, labels, values)`: a counter with a `position` label read as a list, index = position
  (`jaxllm:spec_decode_num_accepted_tokens_per_pos`, as in vLLM), or with an `expert` label, one Vector per
  sparse layer (`jaxllm:moe_expert_tokens`, labels["layer"]: tokens routed to each of the layer's experts);
- `Histogram(name, labels, count, sum, buckets)`: `buckets` maps each upper bound (`le`, "+Inf" included)
  to the cumulative count of observations up to it.

    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name == "jaxllm:spec_decode_num_drafts":
            print(m.value)
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry

PREFIX = "jaxllm:"
# counter name → its index label
VECTORS = {"jaxllm:spec_decode_num_accepted_tokens_per_pos": "position", "jaxllm:moe_expert_tokens": "expert"}


@dataclass
class Metric:
    """One metric under one set of labels (`model_name`, `engine`, and the metric's own)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Vector(Metric):
    """Counters indexed by position (not a Prometheus type: one counter per `position` label on /metrics)."""

    values: list[int]


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each upper bound ("+Inf" included) to the cumulative count."""

    count: int
    sum: float
    buckets: dict[str, int]


def _key(labels: dict[str, str], *drop: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in drop))


def get_metrics_snapshot(registry: CollectorRegistry = REGISTRY, prefix: str = PREFIX) -> list[Metric]:
    """The registry's gauges, counters and histograms whose names start with `prefix`, as `Metric` objects.
    Other collector types (summary, info, ...) are left out."""
    metrics: list[Metric] = []
    for family in registry.collect():
        name = family.name
        if not name.startswith(prefix):
            continue
        if family.type == "gauge":
            metrics += [Gauge(name, dict(s.labels), float(s.value)) for s in family.samples if s.name == name]
        elif family.type == "counter":
            samples = [s for s in family.samples if s.name == name + "_total"]
            index = VECTORS.get(name)
            if index is None:
                metrics += [Counter(name, dict(s.labels), int(s.value)) for s in samples]
                continue
            by_labels: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
            for s in samples:
                by_labels.setdefault(_key(s.labels, index), {})[int(s.labels[index])] = int(s.value)
            for key, by_position in by_labels.items():
                values = [by_position.get(j, 0) for j in range(max(by_position) + 1)]
                metrics.append(Vector(name, dict(key), values))
        elif family.type == "histogram":
            buckets: dict[tuple[tuple[str, str], ...], dict[str, int]] = {}
            counts: dict[tuple[tuple[str, str], ...], int] = {}
            sums: dict[tuple[tuple[str, str], ...], float] = {}
            for s in family.samples:
                if s.name == name + "_bucket":
                    buckets.setdefault(_key(s.labels, "le"), {})[s.labels["le"]] = int(s.value)
                elif s.name == name + "_count":
                    counts[_key(s.labels)] = int(s.value)
                elif s.name == name + "_sum":
                    sums[_key(s.labels)] = float(s.value)
            for key, by_bound in buckets.items():
                metrics.append(Histogram(name, dict(key), counts.get(key, 0), sums.get(key, 0.0), by_bound))
    return metrics

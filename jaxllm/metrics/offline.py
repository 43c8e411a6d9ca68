"""The metrics of an offline `LLM`: the same collectors as `/metrics`, fed from its own steps, read as objects.

Each `LLM` keeps a registry of its own (two engines in one process never mix their counts); its
`generate` hands every step's outputs to `observe` (prompt and generation tokens, latencies, finish
reasons), and `LLM.get_metrics()` adds the engine cores' latest numbers (queue sizes, KV usage,
preemptions, prefix cache, speculation) before reading everything back (`metrics/reader.py`). With
`data_parallel_size > 1` the engine-level numbers are per replica (`engine` label), the request-level
ones all under engine "0": the offline front does not learn which replica served a request.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from jaxllm.metrics.prometheus import PrometheusStatLogger
from jaxllm.metrics.reader import Metric, get_metrics_snapshot
from jaxllm.metrics.stats import OutputStatsTracker
from jaxllm.outputs import RequestOutput


def engine_stats(engine) -> list[dict]:
    """One `EngineCore.stats()` snapshot per engine core behind an `LLM` (a data-parallel one has several)."""
    client = getattr(engine, "client", None)
    return list(client.stats()) if client is not None else [engine.stats()]


class OfflineMetrics:
    def __init__(self, model_name: str, num_engines: int = 1):
        self.registry = CollectorRegistry()
        self._loggers = [PrometheusStatLogger(model_name, i, self.registry) for i in range(num_engines)]
        self._tracker = OutputStatsTracker()

    def observe(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs (cumulative, as `EngineCore.step()` returns them)."""
        if outputs:
            self._loggers[0].record_iteration(self._tracker.observe(outputs, time.monotonic()))

    def snapshot(self, per_engine: list[dict]) -> list[Metric]:
        """Everything so far, the engine cores' numbers as of `per_engine` (one `stats()` dict per core)."""
        for stat_logger, stats in zip(self._loggers, per_engine, strict=False):
            stat_logger.record_engine(stats)
        return get_metrics_snapshot(self.registry)

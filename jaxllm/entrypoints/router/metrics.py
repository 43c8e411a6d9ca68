"""The router's own Prometheus collectors, under `jaxllm:router_`.

They live in a registry per app (not the process-wide one the engine's metrics use), so a router
exports only what it measures and several routers can share a process (the tests do).
"""

from __future__ import annotations

import time
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.responses import Response

from jaxllm.entrypoints.router.instances import Instance, InstancePool

# how a request ended, the `outcome` label of jaxllm:router_requests_total
OUTCOMES = ("success", "client_error", "upstream_error", "unavailable", "aborted")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


def outcome_of(status: int) -> str:
    return "success" if status < 400 else "client_error" if status < 500 else "upstream_error"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "jaxllm:router_requests",
            "Requests the router answered, by route and outcome (success: the decode instance answered "
            "below 400; client_error: a 4xx passed through; upstream_error: a 5xx or a broken answer; "
            "unavailable: no decode instance reachable; aborted: the client left)",
            ["route", "outcome"],
            registry=self.registry,
        )
        self.prefill_fallbacks = Counter(
            "jaxllm:router_prefill_fallbacks",
            "Requests sent straight to a decode instance because no prefill instance answered",
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "jaxllm:router_upstream_errors",
            "Failed calls to an instance: unreachable, timed out, or (prefill) a 5xx",
            ["role", "instance"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "jaxllm:router_in_flight_requests",
            "Requests the router has in flight on each instance",
            ["role", "instance"],
            registry=self.registry,
        )
        self.up = Gauge(
            "jaxllm:router_instance_up",
            "0 while an instance is set aside after a failure (tried after the others), else 1",
            ["role", "instance"],
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "jaxllm:router_request_latency_seconds",
            "From a request's arrival to the last byte of its answer",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill_latency = Histogram(
            "jaxllm:router_prefill_latency_seconds",
            "The prefill phase: from the first try to the kv_transfer_params (successful prefills only)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def record(self, route: str, start: float, outcome: str) -> None:
        """One answered request: its outcome, and its latency from `start` (`time.perf_counter()`)."""
        self.requests.labels(route, outcome).inc()
        self.request_latency.labels(route).observe(time.perf_counter() - start)

    def finish(self, route: str, start: float, response: Response, outcome: str | None = None) -> Response:
        """`record` the request by its response's status (or `outcome`), and return the response."""
        self.record(route, start, outcome or outcome_of(response.status_code))
        return response

    def watch(self, pool: InstancePool) -> None:
        """Export a pool's in-flight counts and state; the gauges read them when scraped."""
        for instance in pool.instances:
            self.in_flight.labels(pool.role, instance.url).set_function(partial(_in_flight, instance))
            self.up.labels(pool.role, instance.url).set_function(partial(_up, instance))
            self.upstream_errors.labels(pool.role, instance.url)  # exported at 0 from the start


def _in_flight(instance: Instance) -> float:
    return instance.in_flight


def _up(instance: Instance) -> float:
    return 0.0 if instance.is_set_aside() else 1.0

"""What a policy sees: each instance's load and health, a request's routing keys, the shared prefix index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxllm.kv_events.index import PrefixIndex

DEFAULT_HEALTH_CHECK_INTERVAL_S = 2.0  # how often the router reads each instance's health and load
SESSION_HEADER = "x-session-id"  # the router's default affinity header (`jaxllm bench serve` sends a trace's session)


@dataclass(eq=False)
class InstanceState:
    name: str  # the instance's URL (the prefix index's key too)
    running: int = 0  # reported by the instance (vllm:num_requests_running)
    waiting: int = 0  # reported by the instance (vllm:num_requests_waiting)
    dispatched: int = 0  # requests sent to it since its last report (so a burst between reports spreads)
    in_flight: int = 0  # the router's requests open on it
    healthy: bool = True

    @property
    def load(self) -> int:
        return self.running + self.waiting + self.dispatched


@dataclass(frozen=True)
class RouteRequest:
    block_hashes: Sequence[bytes] = ()  # the prompt's full blocks, hashed as the instances hash them
    scope: str = ""  # the KV scope root (hex) the hashes chain from
    lora_id: int | None = None
    group: int = 0  # the KV cache group the hashes are matched in
    session: str | None = None  # an affinity key: a header, or the request's `user`


@dataclass
class ClusterView:
    """The instances a request may go to now (healthy, not yet tried for it), and the prefix index."""

    instances: Sequence[InstanceState]
    index: PrefixIndex = field(default_factory=PrefixIndex)


def least_loaded(instances: Sequence[InstanceState], start: int = 0) -> InstanceState:
    """The instance with the lowest load; ties go to the first at or after `start` (round robin among equals)."""
    n = len(instances)
    return min((instances[(start + i) % n] for i in range(n)), key=lambda s: s.load)

"""round_robin: each request to the next instance in turn."""

from __future__ import annotations

from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.view import ClusterView, InstanceState, RouteRequest


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, view: ClusterView) -> InstanceState:
        chosen = view.instances[self._turn % len(view.instances)]
        self._turn += 1
        return chosen

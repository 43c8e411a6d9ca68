"""least_loaded: the instance with the fewest running + waiting requests (as each last reported, plus those sent
to it since); ties in turn."""

from __future__ import annotations

from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.view import ClusterView, InstanceState, RouteRequest, least_loaded


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, view: ClusterView) -> InstanceState:
        self._turn += 1
        return least_loaded(view.instances, self._turn)

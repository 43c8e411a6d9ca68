"""The policy interface (registry.py loads one by name or dotted path)."""

from __future__ import annotations

from jaxllm.routing.view import ClusterView, InstanceState, RouteRequest


class RoutingPolicy:
    """Choose the instance for one request among `view.instances` (never empty).

    `needs_block_hashes`: the router computes the request's block hashes only for policies that read them.
    """

    name = "base"
    needs_block_hashes = False

    def choose(self, request: RouteRequest, view: ClusterView) -> InstanceState:
        raise NotImplementedError

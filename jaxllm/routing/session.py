"""session: a session's requests stick to one instance (affinity on a header or the request's `user`).

Rendezvous hashing: each (session, instance) pair gets a score and the highest-scoring instance wins, so an
instance leaving rotation moves only its own sessions, and every router computes the same choice. A request
without a session goes to the least loaded instance.
"""

from __future__ import annotations

import hashlib

from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.view import ClusterView, InstanceState, RouteRequest, least_loaded


def score(session: str, instance: str) -> bytes:
    return hashlib.sha256(f"{session}\0{instance}".encode()).digest()


class SessionAffinity(RoutingPolicy):
    name = "session"

    def choose(self, request: RouteRequest, view: ClusterView) -> InstanceState:
        if request.session is None:
            return least_loaded(view.instances)
        session = request.session
        return max(view.instances, key=lambda s: score(session, s.name))

"""jaxllm's router policies inside Ray Serve: an ingress that reads each request's routing keys, and a Ray request
router that hands them to the policy (`build_app(..., policy="prefix_aware")` in ray_serve.py).

Ray picks the replica for an HTTP request before its body is read, so a policy that reads the prompt cannot run
in Ray's HTTP proxy. Here the HTTP ingress is a small deployment of its own (`RouterIngress`): it reads the body,
works out the request's `RouteRequest` as `jaxllm router` does (the session from the `x-session-id` header or
`user`; for `prefix_aware` the prompt's block hashes, from one replica's `/tokenize` and the block size and KV scope
root of `/v1/kv_cache_info`), and calls the engine deployment through a handle with those keys as the last
argument. The engine deployment's request router (`JaxLLMRequestRouter`, Ray's `RequestRouter` interface) builds
the policy's `ClusterView` from Ray's replicas: each replica's running and waiting requests from its routing
stats (`record_routing_stats`, every `ROUTING_STATS_PERIOD_S`), plus the requests routed to it since; and the
prefix index from the replicas' KV events, each replica publishing on ports of its own (its stats say where), all
read on one subscriber thread. Ray still does the rest: replicas, autoscaling, health, the queue limit.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, cast

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from jaxllm.entrypoints.router.balancer import route_of, session_of, tokenize_request
from jaxllm.kv_events.index import InstanceView, PrefixIndex
from jaxllm.kv_events.subscriber import SubscriberThread, ZmqEventSubscriber
from jaxllm.routing.registry import load_policy
from jaxllm.routing.view import ClusterView, InstanceState, RouteRequest

logger = logging.getLogger("ray.serve")

ROUTING_STATS_PERIOD_S = 1.0  # how often Ray asks each replica for its load and KV-events address
ROUTED = ("/v1/completions", "/v1/chat/completions")  # where a prompt's keys are read (the rest go by load)


def route_keys(request: RouteRequest | None) -> dict | None:
    """A `RouteRequest` as a handle call's last argument (plain data: it crosses processes)."""
    if request is None:
        return None
    return {"block_hashes": list(request.block_hashes), "scope": request.scope, "session": request.session}


class JaxLLMRequestRouter(FIFOMixin, RequestRouter):
    """Ray's request router for the engine deployment: the replica a jaxllm routing policy chooses."""

    def initialize_state(self, policy: str = "round_robin", **options: Any) -> None:
        self.policy = load_policy(policy, **options)
        self.index = PrefixIndex()
        self.states: dict[ReplicaID, InstanceState] = {}
        self.stats_seen: dict[ReplicaID, float] = {}  # the `at` of the stats each state was last set from
        self.subscriptions: dict[ReplicaID, ZmqEventSubscriber] = {}
        self.subscribers = SubscriberThread()

    def state_of(self, replica: RunningReplica) -> InstanceState:
        rid = replica.replica_id
        state = self.states.get(rid)
        if state is None:
            state = self.states[rid] = InstanceState(rid.unique_id)
        stats = replica.routing_stats or {}
        if stats.get("at") is not None and stats["at"] != self.stats_seen.get(rid):
            state.running, state.waiting, state.dispatched = stats["running"], stats["waiting"], 0
            self.stats_seen[rid] = stats["at"]
        if rid not in self.subscriptions and stats.get("kv_events"):
            sub = self.subscriptions[rid] = ZmqEventSubscriber(
                stats["kv_events"], InstanceView(self.index, rid.unique_id), replay_endpoint=stats.get("replay")
            )
            self.subscribers.add(sub)
            logger.info("KV events of replica %s from %s", rid.unique_id, stats["kv_events"])
        return state

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        states = [self.state_of(r) for r in candidate_replicas]
        keys = pending_request.args[-1] if pending_request is not None and pending_request.args else None
        request = RouteRequest(**keys) if isinstance(keys, dict) else RouteRequest()
        chosen = self.policy.choose(request, ClusterView(states, self.index))
        return [[candidate_replicas[next(i for i, s in enumerate(states) if s is chosen)]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        state = self.states.get(replica_id)
        if state is not None:
            state.dispatched += 1
            state.in_flight += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        state = self.states.get(replica_id)
        if state is not None:
            state.in_flight = max(state.in_flight - 1, 0)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.states.pop(replica_id, None)
        forget = functools.partial(self.index.forget, replica_id.unique_id)
        sub = self.subscriptions.pop(replica_id, None)
        if sub is None:
            forget()
        else:  # on the subscriber thread, after its last events: none can land after the forgetting
            self.subscribers.remove(sub, then=forget)


class RouterIngress:
    """The HTTP ingress: every request to the engine deployment, with its routing keys."""

    def __init__(self, engines: DeploymentHandle, needs_block_hashes: bool = False):
        self.engines = engines
        self.needs_block_hashes = needs_block_hashes
        self.cache_info: dict | None = None  # block size and scope root (every replica's are the same)

    async def __call__(self, request):
        from starlette.responses import StreamingResponse

        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        path = request.url.path.removeprefix(request.scope.get("root_path", "")) or "/"  # under the app's prefix
        if request.url.query:
            path = f"{path}?{request.url.query}"
        keys = None
        if request.method == "POST" and request.url.path.endswith(ROUTED):
            keys = route_keys(await self.route_request(path, body, headers))
        stream = self.proxy(request.method, path, headers, body, keys)
        head = await stream.__anext__()
        return StreamingResponse(stream, status_code=head["status"], headers=head["headers"])

    def proxy(self, method: str, path: str, headers: dict[str, str], body: bytes, keys: dict | None):
        """The request on an engine replica (`JaxLLMDeployment.proxy`): its head, then its body's chunks."""
        call = self.engines.options(stream=True).proxy.remote(method, path, headers, body, keys)
        return cast(DeploymentResponseGenerator, call)

    async def route_request(self, path: str, raw: bytes, headers: dict[str, str]) -> RouteRequest:
        try:
            body = json.loads(raw)
        except ValueError:
            return RouteRequest()  # the replica answers the 400
        if not isinstance(body, dict):
            return RouteRequest()
        session = session_of(headers, body)
        if not self.needs_block_hashes:
            return RouteRequest(session=session)
        tokens = await self.tokens(path, body, headers)
        info = await self.kv_cache_info(headers)
        return RouteRequest(session=session) if info is None else route_of(tokens, info, session)

    async def tokens(self, path: str, body: dict, headers: dict[str, str]) -> list[int] | None:
        """The prompt's token ids as a replica renders and tokenizes it (None: route by load alone)."""
        request = tokenize_request(path, body)
        if request is None or isinstance(request, list):
            return request
        answer = await self.call("POST", "/tokenize", headers, json.dumps(request).encode())
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return tokens if isinstance(tokens, list) else None

    async def kv_cache_info(self, headers: dict[str, str]) -> dict | None:
        if self.cache_info is None:
            answer = await self.call("GET", "/v1/kv_cache_info", headers, b"")
            if isinstance(answer, dict) and answer.get("kv_scope_root"):
                self.cache_info = answer
        return self.cache_info

    async def call(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Any:
        """A small request to any replica (by load), its JSON answer (None: not a 200)."""
        chunks = []
        stream = self.proxy(method, path, headers, body, None)
        head = await stream.__anext__()
        async for chunk in stream:
            chunks.append(chunk)
        if head["status"] != 200:
            return None
        try:
            return json.loads(b"".join(chunks))
        except ValueError:
            return None


def router_ingress(name: str):
    """The ingress as a Ray Serve deployment (the class is plain, so it imports without a Ray cluster)."""
    return serve.deployment(name=f"{name}-router")(RouterIngress)

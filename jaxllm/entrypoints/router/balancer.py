"""N equal instances behind one front: a routing policy (jaxllm/routing/) picks each request's instance.

The balancer feeds the policy's view: every `health_check_interval` seconds each instance's `/health` and
`/metrics` (running + waiting) are read at once; an instance that fails a check, or refuses a connection, leaves
rotation until a check passes again, and requests waiting on its answer then fail at once (503) instead of
hanging. Its `/v1/kv_cache_info` (block size, KV scope root, KV events endpoint) is read once; KV events feed the
prefix index (kv_events/), for `prefix_aware`.

Block hashes: the router asks an instance's `/tokenize` for the prompt's token ids (the chat template and the
tokenizer are the instance's own) and hashes them with the instance's block size and scope root, as its KV
manager does (engine/block_hash.py). One round trip per request, only for policies that read hashes; in exchange
the router loads no tokenizer or template and cannot disagree with the instances about them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi.responses import Response
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.engine.block_hash import prefix_hashes
from jaxllm.entrypoints.router.metrics import RouterMetrics, outcome_of
from jaxllm.entrypoints.router.proxy import PassthroughResponse, describe, error_body, error_response
from jaxllm.kv_events.index import InstanceView, PrefixIndex
from jaxllm.kv_events.subscriber import SubscriberThread, ZmqEventSubscriber
from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.view import (
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    SESSION_HEADER,
    ClusterView,
    InstanceState,
    RouteRequest,
)

logger = logging.getLogger("jaxllm.router")


@dataclass
class Instance:
    state: InstanceState
    kv_events: str | None = None  # the PUB endpoint ("tcp://h:5557" or "tcp://h:5557,tcp://h:5558" with replay)
    info: dict[str, Any] | None = None  # its /v1/kv_cache_info
    last_error: str | None = None
    down: asyncio.Event | None = None  # set when it leaves rotation: requests waiting on it stop waiting
    subscriber: ZmqEventSubscriber | None = None

    @property
    def url(self) -> str:
        return self.state.name


def parse_kv_events(value: str) -> tuple[str, str | None]:
    endpoint, _, replay = value.partition(",")
    for address in (endpoint, replay):
        if address and "://" not in address:
            raise ValueError(f"--kv-events {value!r}: not a ZeroMQ address such as tcp://host:5557[,tcp://host:5558]")
    return endpoint, replay or None


def on_host(endpoint: str | None, url: str) -> str | None:
    """An instance's bind address (tcp://*:5557) as the router reaches it (tcp://instance-host:5557)."""
    if endpoint is None:
        return None
    host = urlsplit(url).hostname or "127.0.0.1"
    for wildcard in ("*", "0.0.0.0"):
        endpoint = endpoint.replace(f"://{wildcard}:", f"://{host}:")
    return endpoint


def tokenize_request(route: str, body: dict) -> dict | list[int] | None:
    """What to ask an instance's `/tokenize` for a request's prompt: the body of that call, or the token ids when
    the request gives them, or None (no single prompt: a batch, or no messages)."""
    if route.endswith("chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        keep = ("messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt", "model")
        return {k: body[k] for k in keep if k in body}
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if not isinstance(prompt, str):
        return None
    return {"prompt": prompt, **({"model": body["model"]} if "model" in body else {})}


def block_hashes(tokens: list[int], block_size: int, root_hex: str) -> list[bytes]:
    """The chained hashes of the full blocks of `tokens`, as the instance's KV manager names them."""
    return prefix_hashes(tokens, block_size, bytes.fromhex(root_hex))


def session_of(headers: dict[str, str], body: dict[str, Any], header: str = SESSION_HEADER) -> str | None:
    """A request's affinity key: its session header (lower-case name), else the body's `user`."""
    session = headers.get(header)
    if session is None and isinstance(body.get("user"), str):
        session = body["user"]
    return session


def route_of(tokens: list[int] | None, info: dict[str, Any], session: str | None) -> RouteRequest:
    """A request's routing keys from its prompt's token ids (None: unknown) hashed as the instance whose
    `/v1/kv_cache_info` is `info` hashes them."""
    if tokens is None:
        return RouteRequest(session=session)
    root = info["kv_scope_root"]
    return RouteRequest(block_hashes(tokens, int(info["block_size"]), root), root, session=session)


class Balancer:
    def __init__(
        self,
        urls: list[str],
        policy: RoutingPolicy,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        *,
        kv_events: list[str] | None = None,
        health_check_interval: float = DEFAULT_HEALTH_CHECK_INTERVAL_S,
        health_timeout: float = 5.0,
        session_header: str = SESSION_HEADER,
    ):
        if kv_events is not None and len(kv_events) != len(urls):
            raise ValueError(f"--kv-events names {len(kv_events)} endpoints for {len(urls)} --instances: one each")
        if not health_check_interval > 0:
            raise ValueError(f"--health-check-interval must be more than 0 seconds, got {health_check_interval}")
        for value in kv_events or []:
            parse_kv_events(value)
        self.instances = [
            Instance(InstanceState(url), kv_events[i] if kv_events else None) for i, url in enumerate(urls)
        ]
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.index = PrefixIndex()
        self.subscribers = SubscriberThread()  # every instance's KV events, on one thread (from the first found)
        self.health_check_interval = health_check_interval
        self.health_timeout = min(health_timeout, health_check_interval * 2)
        self.session_header = session_header.lower()
        for instance in self.instances:
            metrics.in_flight.labels("instance", instance.url).set_function(partial(_in_flight, instance.state))
            metrics.up.labels("instance", instance.url).set_function(partial(_up, instance.state))
            metrics.upstream_errors.labels("instance", instance.url)

    # ---- health and load -------------------------------------------------------------------------

    async def run_health_checks(self) -> None:
        """Check every instance each interval, until cancelled."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.health_check_interval)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(instance) for instance in self.instances))

    async def check(self, instance: Instance) -> None:
        try:
            health = await self.client.get(instance.url + "/health", timeout=self.health_timeout)
            if health.status_code != 200:
                raise RuntimeError(f"/health answered HTTP {health.status_code}")
            metrics = await self.client.get(instance.url + "/metrics", timeout=self.health_timeout)
            running = waiting = 0.0
            if metrics.status_code == 200:
                for family in text_string_to_metric_families(metrics.text):
                    if family.name.endswith(":num_requests_running"):
                        running += sum(s.value for s in family.samples)
                    elif family.name.endswith(":num_requests_waiting"):
                        waiting += sum(s.value for s in family.samples)
            if instance.info is None:
                await self.discover(instance)
        except Exception as e:  # unreachable, timed out, unhealthy, or a broken answer
            self.out_of_rotation(instance, describe(e) if isinstance(e, httpx.HTTPError) else str(e))
            return
        state = instance.state
        state.running, state.waiting, state.dispatched = int(running), int(waiting), 0
        if not state.healthy:
            logger.info("instance %s answers again: back in rotation", instance.url)
        state.healthy, instance.last_error = True, None
        if instance.down is not None and instance.down.is_set():
            instance.down = asyncio.Event()

    async def discover(self, instance: Instance) -> None:
        """Its block size and KV scope root, and its KV events (subscribed to once)."""
        response = await self.client.get(instance.url + "/v1/kv_cache_info", timeout=self.health_timeout)
        if response.status_code != 200:
            return  # an instance without the endpoint: load-based policies still work
        instance.info = response.json()
        if instance.subscriber is not None:
            return
        endpoint: str | None
        replay: str | None
        if instance.kv_events is not None:
            endpoint, replay = parse_kv_events(instance.kv_events)
        else:
            config = instance.info.get("kv_events") or {}
            if config.get("publisher") != "zmq":
                return
            endpoint = on_host(config.get("endpoint"), instance.url)
            replay = on_host(config.get("replay_endpoint"), instance.url)
        if endpoint is None:
            return
        sub = ZmqEventSubscriber(
            endpoint,
            InstanceView(self.index, instance.url),
            replay_endpoint=replay,
            topic=str((instance.info.get("kv_events") or {}).get("topic", "")),
        )
        instance.subscriber = sub
        self.subscribers.add(sub)
        logger.info("KV events of %s from %s (replay %s)", instance.url, endpoint, replay)

    def out_of_rotation(self, instance: Instance, error: str) -> None:
        if instance.state.healthy:
            logger.warning("instance %s leaves rotation: %s", instance.url, error)
        instance.state.healthy, instance.last_error = False, error
        if instance.down is None:
            instance.down = asyncio.Event()
        instance.down.set()  # requests waiting on its answer fail now

    def close(self) -> None:
        self.subscribers.stop()

    # ---- one request ---------------------------------------------------------------------------

    async def route_request(self, route: str, body: dict[str, Any], headers: dict[str, str]) -> RouteRequest:
        session = session_of(headers, body, self.session_header)
        if not self.policy.needs_block_hashes:
            return RouteRequest(session=session)
        live = [i for i in self.instances if i.state.healthy and i.info is not None]
        if not live:
            return RouteRequest(session=session)
        target = min(live, key=lambda i: i.state.load)
        assert target.info is not None
        return route_of(await self.tokens(target, route, body, headers), target.info, session)

    async def tokens(self, instance: Instance, route: str, body: dict, headers: dict[str, str]) -> list[int] | None:
        """The prompt's token ids as the instance renders and tokenizes it (None: not known; route by load)."""
        request = tokenize_request(route, body)
        if request is None or isinstance(request, list):
            return request
        try:
            response = await self.client.post(
                instance.url + "/tokenize", json=request, headers=headers, timeout=self.health_timeout
            )
            tokens = response.json().get("tokens") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return tokens if isinstance(tokens, list) else None

    async def completion(self, route: str, raw_body: bytes, headers: dict[str, str]) -> Response:
        start = time.perf_counter()
        try:
            body = json.loads(raw_body)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            return self.metrics.finish(route, start, error_response(400, f"the request body is not a JSON object: {e}"))
        routed = await self.route_request(route, body, headers)
        tried: set[int] = set()
        errors: list[str] = []
        while True:
            candidates = [i for i in self.instances if i.state.healthy and id(i) not in tried]
            if not candidates:
                down = [f"{i.url}: {i.last_error}" for i in self.instances if i.last_error] or ["none healthy"]
                message = "no instance available: " + "; ".join(errors or down)
                return self.metrics.finish(route, start, error_response(503, message), outcome="unavailable")
            state = self.policy.choose(routed, ClusterView([i.state for i in candidates], self.index))
            instance = next((i for i in candidates if i.state is state), None)
            if instance is None:
                raise RuntimeError(f"policy {self.policy.name} chose an instance it was not offered")
            tried.add(id(instance))
            response = await self.send(instance, route, raw_body, headers, start)
            if response is not None:
                return response
            errors.append(f"{instance.url}: {instance.last_error}")

    async def send(
        self, instance: Instance, route: str, raw_body: bytes, headers: dict[str, str], start: float
    ) -> Response | None:
        """The instance's answer, streamed back; None when it could not be reached (nothing ran: try another)."""
        state = instance.state
        state.dispatched += 1
        state.in_flight += 1
        if instance.down is None or instance.down.is_set():
            instance.down = asyncio.Event()
        request = self.client.build_request("POST", instance.url + route, content=raw_body, headers=headers)
        sending = asyncio.ensure_future(self.client.send(request, stream=True))
        down = asyncio.ensure_future(instance.down.wait())
        try:
            await asyncio.wait({sending, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not sending.done():
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
        if sending.cancelled():  # it left rotation while we waited for its answer: fail now, never hang
            state.in_flight -= 1
            message = f"instance {instance.url} stopped answering its health checks: {instance.last_error}"
            return self.metrics.finish(route, start, error_response(503, message), outcome="unavailable")
        error = sending.exception()
        if error is not None:
            state.in_flight -= 1
            if not isinstance(error, httpx.HTTPError):
                raise error
            self.metrics.upstream_errors.labels("instance", instance.url).inc()
            if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):  # never reached: out, try another
                self.out_of_rotation(instance, describe(error))
                return None
            status = 504 if isinstance(error, httpx.TimeoutException) else 502
            return self.metrics.finish(
                route, start, error_response(status, f"instance {instance.url}: {describe(error)}")
            )
        upstream = sending.result()

        def close(outcome: str) -> None:
            state.in_flight -= 1
            self.metrics.record(route, start, outcome)

        return WatchedResponse(upstream, on_close=close, down=instance.down, instance=instance)

    # ---- bookkeeping -----------------------------------------------------------------------------

    async def forward_get(self, path: str, headers: dict[str, str]) -> Response:
        errors = []
        for instance in sorted(self.instances, key=lambda i: not i.state.healthy):
            try:
                response = await self.client.get(instance.url + path, headers=headers)
            except httpx.HTTPError as e:
                errors.append(f"{instance.url}: {describe(e)}")
                continue
            return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))
        return error_response(503, "no instance could be reached: " + "; ".join(errors))

    def health(self) -> dict[str, str]:
        return {i.url: "ok" if i.state.healthy else (i.last_error or "down") for i in self.instances}


class WatchedResponse(PassthroughResponse):
    """An instance's answer streamed back, cut short when the instance leaves rotation (it stopped answering its
    health checks): the client gets an error at once (in the stream, for server-sent events) instead of waiting
    on a hung instance until --timeout."""

    def __init__(self, upstream: httpx.Response, *, on_close, down: asyncio.Event, instance: Instance):
        self.down = down
        self.instance = instance
        super().__init__(upstream, on_close=on_close)

    async def _chunks(self) -> AsyncIterator[bytes]:
        chunks = self.upstream.aiter_bytes().__aiter__()
        while True:
            following = asyncio.ensure_future(chunks.__anext__())
            down = asyncio.ensure_future(self.down.wait())
            try:
                await asyncio.wait({following, down}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the client left (often just after the last chunk): read no more
                following.cancel()
                raise
            finally:
                down.cancel()
            if not following.done():  # it left rotation mid-answer
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
                yield from_broken(self, f"it stopped answering its health checks: {self.instance.last_error}")
                return
            error = following.exception()
            if isinstance(error, StopAsyncIteration):
                break
            if isinstance(error, httpx.HTTPError):
                yield from_broken(self, describe(error))
                return
            if error is not None:
                raise error
            yield following.result()
        self.outcome = outcome_of(self.upstream.status_code)


def from_broken(response: WatchedResponse, reason: str) -> bytes:
    """The answer broke off: count it, log it, and (server-sent events: the status is already sent) say so."""
    response.outcome = "upstream_error"
    logger.warning("the instance at %s broke off its answer: %s", response.instance.url, reason)
    if not response.is_sse:
        return b""
    error = error_body(502, f"the instance {response.instance.url} broke off: {reason}")
    return f"data: {json.dumps(error)}\n\n".encode()


def _in_flight(state: InstanceState) -> float:
    return state.in_flight


def _up(state: InstanceState) -> float:
    return float(state.healthy)

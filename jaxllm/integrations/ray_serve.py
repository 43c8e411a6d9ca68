"""Ray Serve: jaxllm replicas behind Ray's HTTP proxy, answering the routes of `jaxllm serve`.

Each replica is one `AsyncLLM` (one engine on its own devices) serving the very FastAPI app
of `jaxllm serve` (`api_server.build_app`). Ray Serve starts the replicas where their
resources are free, routes each HTTP request to one of them, scales their number
(`num_replicas`, or `autoscaling_config` on ongoing requests) and replaces a replica whose
health check fails.

    from ray import serve
    from jaxllm.integrations.ray_serve import build_app

    serve.run(build_app({"max_num_seqs": 64}, num_replicas=2))   # http://127.0.0.1:8000/v1/...

or from a shell: `serve run jaxllm.integrations.ray_serve:app_builder num_replicas=2 max_num_seqs=64`.

Routing is Ray's default (power of two choices on each replica's ongoing requests), or with `policy=` one of
jaxllm's router policies (ray_router.py: an HTTP ingress reads the routing keys, a Ray request router applies the
policy). Ray's own prefix-cache-aware router (`PrefixCacheAffinityRouter`) cannot help the plain app: Ray picks the
replica for an HTTP request from its headers alone, before the body (the prompt) is read. See docs/scaling.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from jaxllm.engine.args import EngineArgs

REPLICA_HEADER = "x-jaxllm-replica"

logger = logging.getLogger("ray.serve")  # Ray writes it to the replica's log


@serve.ingress()
class JaxLLMDeployment:
    """One replica: an `AsyncLLM` and the OpenAI app of `jaxllm serve` over it."""

    # Ray Serve awaits an async constructor; mypy allows only `-> None` on __init__
    async def __init__(  # type: ignore[misc]
        self, engine_args: EngineArgs, served_model_name: str | None = None, api_key: str | None = None
    ):
        import jax

        from jaxllm.engine.async_llm import AsyncLLM

        # On CPU a replica sees tensor_parallel_size host devices; on GPU Ray has already narrowed
        # CUDA_VISIBLE_DEVICES to the replica's num_gpus.
        jax.config.update("jax_num_cpu_devices", engine_args.tensor_parallel_size)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.served_model_name = served_model_name
        self.api_key = api_key
        # loading and compiling take minutes on CPU: keep the replica's event loop free meanwhile
        self.engine = await asyncio.to_thread(AsyncLLM, engine_args, served_model_name=served_model_name)

    def __serve_build_asgi_app__(self):
        from jaxllm.entrypoints.openai.api_server import build_app as build_openai_app

        names = [self.served_model_name] if self.served_model_name else None
        app = build_openai_app(self.engine, served_model_names=names, api_key=self.api_key)
        app.add_middleware(ReplicaHeader, replica_id=self.replica_id)
        self.asgi_app = app  # what `proxy` runs a handle call's request through
        return app

    async def proxy(self, method: str, path: str, headers: dict[str, str], body: bytes, route: dict | None = None):
        """One HTTP request through this replica's app, for a handle call (the routed app's ingress): yields
        {"status", "headers"}, then the body's chunks as they come. `route` is for the request router only."""
        async for item in asgi_stream(self.asgi_app, method, path, headers, body):
            yield item

    def record_routing_stats(self) -> dict[str, Any]:
        """What the routed app's request router reads (Ray asks every `request_routing_stats_period_s`): the
        engine's running and waiting requests, and where its KV events are published."""
        import time

        import ray

        stats = self.engine.stats()
        routing: dict[str, Any] = {"at": time.time(), "running": stats["num_running"], "waiting": stats["num_waiting"]}
        events = self.engine.info.kv_events or {}
        if events.get("publisher") == "zmq":
            host = ray.util.get_node_ip_address()
            for key, name in (("endpoint", "kv_events"), ("replay_endpoint", "replay")):
                if events.get(key):
                    routing[name] = events[key].replace("://0.0.0.0:", f"://{host}:").replace("://*:", f"://{host}:")
        return routing

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose engine died is replaced."""
        self.engine.check_health()

    def __del__(self):
        """Replica teardown (scale-down, redeploy, `serve.shutdown()`): end streams, stop the engine."""
        if not hasattr(self, "engine"):  # the engine failed to start: nothing to stop
            return
        self.engine.stop_accepting("the replica is shutting down")
        self.engine.abort_all()
        self.engine.shutdown()
        logger.info("replica %s: engine stopped", self.replica_id)


async def asgi_stream(app, method: str, path: str, headers: dict[str, str], body: bytes):
    """Run one HTTP request through an ASGI app in this process: yields {"status", "headers"} first, then the body's
    chunks. Closing the generator early (the client left) tells the app the client disconnected."""
    messages: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }
    task = asyncio.create_task(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                raw = message.get("headers", [])
                yield {"status": message["status"], "headers": {k.decode(): v.decode() for k, v in raw}}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        left.set()  # a stream still running sees the disconnect and aborts its request
        await asyncio.wait([task], timeout=5)
        if not task.done():
            task.cancel()


class ReplicaHeader:
    """Tags every response with `x-jaxllm-replica: <Ray Serve replica id>`: which replica served it.

    A plain ASGI middleware, like the API-key one: it must not wrap `receive`, which streams use
    to see disconnects.
    """

    def __init__(self, app, replica_id: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_tagged)


def build_app(
    engine_args: EngineArgs | dict[str, Any] | None = None,
    *,
    num_replicas: int | str | None = None,
    autoscaling_config: dict | str | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_ongoing_requests: int = 256,
    request_router: RequestRouterConfig | None = None,
    policy: str | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    name: str = "jaxllm",
) -> serve.Application:
    """A Ray Serve application of jaxllm replicas; run it with `serve.run(app)` or `serve run`.

    engine_args: `EngineArgs`, or a dict of its fields (vLLM's names). A dict may also carry every
        keyword below, as `serve run` passes them to `app_builder` (strings are converted to each
        field's type; autoscaling_config as JSON).
    num_replicas: a fixed count (default 1), or "auto"; exclusive with autoscaling_config.
    autoscaling_config: Ray's dict, e.g. {"min_replicas": 1, "max_replicas": 4,
        "target_ongoing_requests": 32}: replicas are added while each has more requests in
        flight than the target. An engine batches, so the target should be near max_num_seqs.
    num_cpus / num_gpus: what one replica reserves. On GPU use num_gpus=tensor_parallel_size;
        Ray then gives each replica its own GPUs (CUDA_VISIBLE_DEVICES).
    max_ongoing_requests: requests Ray lets into one replica at once (the rest queue at the
        proxy); keep it above max_num_seqs so the engine's batch can fill.
    request_router: Ray's `RequestRouterConfig` (default: Ray's power-of-two router).
    policy: route with a `jaxllm router` policy instead (round_robin, least_loaded, session, prefix_aware, or a
        dotted path): the application is then a small HTTP ingress deployment (`{name}-router`, reading each
        request's session and prompt) in front of the engine replicas, whose Ray request router applies the policy
        (ray_router.py); for prefix_aware the replicas publish KV events on ports of their own.
    """
    if engine_args is None or isinstance(engine_args, dict):
        settings = dict(engine_args or {})
        options = {k: settings.pop(k) for k in list(settings) if k in DEPLOYMENT_OPTIONS}
        keywords: dict[str, Any] = dict(
            num_replicas=num_replicas,
            autoscaling_config=autoscaling_config,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_ongoing_requests=max_ongoing_requests,
            request_router=request_router,
            policy=policy,
            served_model_name=served_model_name,
            api_key=api_key,
            name=name,
        )
        keywords.update({k: _parse_option(k, v) for k, v in options.items()})
        return build_app(engine_args_from_dict(settings), **keywords)
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if engine_args.nnodes > 1:
        raise ValueError("a Ray Serve replica runs on one node: nnodes must be 1 (scale out with more replicas)")
    routing = None
    if policy is not None:
        if request_router is not None:
            raise ValueError("give policy (a jaxllm router policy) or request_router (Ray's), not both")
        routing, engine_args = routed(engine_args, policy)
        request_router = routing.config
    options = dict(
        num_replicas=num_replicas, autoscaling_config=autoscaling_config, request_router_config=request_router
    )
    deployment = serve.deployment(name=name)(JaxLLMDeployment).options(
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        **{k: v for k, v in options.items() if v is not None},
    )  # None: Ray's default
    engines = deployment.bind(engine_args, served_model_name, api_key)
    if routing is None:
        return engines
    from jaxllm.integrations.ray_router import router_ingress

    # the ingress only reads bodies and forwards streams: no CPU reserved, and no queue limit of its own
    ingress = router_ingress(name).options(max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engines, routing.needs_block_hashes)


INGRESS_MAX_ONGOING = 100_000


@dataclasses.dataclass
class Routing:
    config: RequestRouterConfig  # the engine deployment's request router
    needs_block_hashes: bool  # the ingress reads the prompt's block hashes


def routed(engine_args: EngineArgs, policy: str) -> tuple[Routing, EngineArgs]:
    """The request router for `policy` (a bad name fails here, before Ray starts anything), and the engine
    arguments: a policy that reads block hashes gets the replicas' KV events over ZeroMQ on ports of their own,
    unless the arguments already say where."""
    from jaxllm.integrations.ray_router import ROUTING_STATS_PERIOD_S, JaxLLMRequestRouter
    from jaxllm.routing.registry import load_policy

    needs_hashes = load_policy(policy).needs_block_hashes
    if needs_hashes and engine_args.kv_events_config is None:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:*"}
        engine_args = dataclasses.replace(engine_args, kv_events_config={**events, "replay_endpoint": "tcp://*:*"})
    options: dict[str, Any] = {
        "request_router_class": JaxLLMRequestRouter,
        "request_router_kwargs": {"policy": policy},
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }
    config = RequestRouterConfig(**options)
    return Routing(config, needs_hashes), engine_args


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For `serve run jaxllm.integrations.ray_serve:app_builder key=value ...` (and Serve config
    files' `import_path`), which call a builder with one dict: engine settings and deployment options."""
    return build_app(args)


DEPLOYMENT_OPTIONS: dict[str, Callable[[str], Any] | None] = {  # option → its parser (None: taken as given)
    "num_replicas": int,
    "autoscaling_config": json.loads,
    "num_cpus": float,
    "num_gpus": float,
    "max_ongoing_requests": int,
    "request_router": None,
    "policy": str,
    "served_model_name": str,
    "api_key": str,
    "name": str,
}


def _parse_option(key: str, value: Any) -> Any:
    parse = DEPLOYMENT_OPTIONS[key]
    if not isinstance(value, str) or parse is None or (key == "num_replicas" and value == "auto"):
        return value
    try:
        return parse(value)
    except ValueError:
        expected = "JSON" if parse is json.loads else parse.__name__
        raise ValueError(f"{key} must be {expected}, got {value!r}") from None


def engine_args_from_dict(settings: dict[str, Any]) -> EngineArgs:
    """`EngineArgs(**settings)`, with string values (from a command line) turned into each field's type."""
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown engine setting(s) {unknown}; EngineArgs has {sorted(fields)}, "
            f"the deployment takes {sorted(DEPLOYMENT_OPTIONS)}"
        )
    return EngineArgs(**{k: _parse_field(fields[k], v) for k, v in settings.items()})


def _parse_field(field: dataclasses.Field, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if value.lower() == "none" and "None" in field.type:
        return None
    if field.type == "bool":
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{field.name} must be true or false, got {value!r}")
        return value.lower() in ("true", "1")
    # field.type is the annotation's text (from __future__ import annotations)
    kind = {"int": int, "int | None": int, "float": float}.get(str(field.type), str)
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{field.name} must be {kind.__name__}, got {value!r}") from None

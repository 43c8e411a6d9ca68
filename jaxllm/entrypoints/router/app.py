"""The router's FastAPI app: routes only; proxy.py does the work.

The generation routes race the proxy against the client's connection, as the server's routes do:
a client that leaves before its answer starts cancels both phases, which closes the calls to the
instances, so they abort the request instead of computing it for nobody.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.entrypoints.router.balancer import Balancer
from jaxllm.entrypoints.router.instances import InstancePool
from jaxllm.entrypoints.router.metrics import RouterMetrics
from jaxllm.entrypoints.router.proxy import HEALTH_TIMEOUT_S, Proxy, error_response
from jaxllm.routing.registry import load_policy
from jaxllm.routing.view import DEFAULT_HEALTH_CHECK_INTERVAL_S, SESSION_HEADER

DEFAULT_TIMEOUT_S = 300.0  # --timeout
CONNECT_TIMEOUT_S = 5.0  # an instance that takes longer to accept a connection counts as down


def make_client(timeout: float) -> httpx.AsyncClient:
    """One connection pool for every instance. `timeout` bounds each wait: connecting, and each read of
    an answer (for a non-streamed completion that is the whole generation). No proxy from the
    environment: the instances are addressed directly."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


def build_app(prefill_urls: list[str], decode_urls: list[str], *, timeout: float = DEFAULT_TIMEOUT_S) -> FastAPI:
    if not timeout > 0:
        raise ValueError(f"--timeout must be more than 0 seconds, got {timeout}")
    prefill, decode = InstancePool("prefill", prefill_urls), InstancePool("decode", decode_urls)
    metrics = RouterMetrics()
    metrics.watch(prefill)
    metrics.watch(decode)
    client = make_client(timeout)
    proxy = Proxy(prefill, decode, client, metrics, health_timeout=min(timeout, HEALTH_TIMEOUT_S))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="jaxllm router (disaggregated prefill/decode)", version=jaxllm.__version__, lifespan=lifespan)
    app.state.proxy = proxy
    app.state.metrics = metrics
    add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await until_disconnect(raw, proxy.completion("/v1/completions", await raw.body(), forwarded(raw)))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await until_disconnect(raw, proxy.completion("/v1/chat/completions", await raw.body(), forwarded(raw)))

    @app.get("/v1/models")
    async def models(raw: Request):
        return await proxy.forward_get("/v1/models", forwarded(raw, request_id=False))

    @app.get("/health")
    async def health():
        report = await proxy.health()
        if "ok" not in report["decode"].values():
            down = "; ".join(f"{url}: {result}" for url, result in report["decode"].items())
            return error_response(503, f"no decode instance answers /health ({down})")
        return JSONResponse({"status": "ok", **report})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def build_balanced_app(
    urls: list[str],
    *,
    policy: str = "round_robin",
    policy_options: dict | None = None,
    kv_events: list[str] | None = None,
    health_check_interval: float = DEFAULT_HEALTH_CHECK_INTERVAL_S,
    session_header: str = SESSION_HEADER,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> FastAPI:
    """N equal instances behind one front, a routing policy choosing each request's (balancer.py)."""
    if not timeout > 0:
        raise ValueError(f"--timeout must be more than 0 seconds, got {timeout}")
    pool = InstancePool("instances", urls)  # the URLs checked as --prefill/--decode are
    chosen = load_policy(policy, **(policy_options or {}))
    metrics = RouterMetrics()
    client = make_client(timeout)
    balancer = Balancer(
        [i.url for i in pool.instances],
        chosen,
        client,
        metrics,
        kv_events=kv_events,
        health_check_interval=health_check_interval,
        health_timeout=min(timeout, HEALTH_TIMEOUT_S),
        session_header=session_header,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        checks = asyncio.ensure_future(balancer.run_health_checks())
        yield
        checks.cancel()
        await asyncio.gather(checks, return_exceptions=True)
        balancer.close()
        await client.aclose()

    app = FastAPI(title=f"jaxllm router ({chosen.name})", version=jaxllm.__version__, lifespan=lifespan)
    app.state.balancer = balancer
    app.state.metrics = metrics
    add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        work = balancer.completion("/v1/completions", await raw.body(), forwarded(raw, session=session_header))
        return await until_disconnect(raw, work)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        work = balancer.completion("/v1/chat/completions", await raw.body(), forwarded(raw, session=session_header))
        return await until_disconnect(raw, work)

    @app.get("/v1/models")
    async def models(raw: Request):
        return await balancer.forward_get("/v1/models", forwarded(raw, request_id=False))

    @app.get("/health")
    async def health():
        report = balancer.health()
        if "ok" not in report.values():
            return error_response(
                503, "no instance is in rotation (" + "; ".join(f"{u}: {r}" for u, r in report.items()) + ")"
            )
        return JSONResponse({"status": "ok", "instances": report})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every failure as OpenAI's error JSON, as the instances answer."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        return error_response(500, f"the router failed: {type(e).__name__}: {e}")


def forwarded(raw: Request, *, request_id: bool = True, session: str | None = None) -> dict[str, str]:
    """The headers the instances get: the client's Authorization as given, and one request id that both
    phases share (the client's X-Request-Id, else a new one), so their logs line up; the session header
    (`session`: its name) when the client sent one."""
    headers = {}
    if "authorization" in raw.headers:
        headers["authorization"] = raw.headers["authorization"]
    if session is not None and session.lower() in raw.headers:
        headers[session.lower()] = raw.headers[session.lower()]
    if request_id:
        headers["x-request-id"] = raw.headers.get("x-request-id") or uuid.uuid4().hex
    return headers


async def until_disconnect(raw: Request, work: Awaitable[Response]) -> Response:
    """The proxy's response, unless the client leaves first (then 499, and the work is cancelled).

    Once a response is returned, a streamed answer watches the connection itself (PassthroughResponse).
    """
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():  # the client left (or the router is stopping)
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
    if handler.cancelled():
        return Response(status_code=499)
    return handler.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass

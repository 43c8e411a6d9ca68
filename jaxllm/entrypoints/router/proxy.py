"""The two phases of a completion, as vLLM's P/D proxy runs them, and what happens when one fails.

1. Prefill: the request goes to a prefill instance with `max_tokens` 1, not streamed, one choice,
   and `kv_transfer_params: {"do_remote_decode": true}`; the instance computes the prompt's KV, keeps
   it for a decode instance and answers `kv_transfer_params` saying where to fetch it.
2. Decode: the client's own request, plus those params, goes to a decode instance, whose answer
   (JSON or server-sent events, any status) is streamed back unchanged.

A prefill instance that is unreachable, times out or answers 5xx is followed by the next; when none
answers, the decode instance gets the request without params and computes the prompt itself (a
fallback: slower, never wrong). A prefill 4xx is the client's mistake and goes back as it is. A
decode instance that cannot be reached is followed by the next (nothing was sent to it, so nothing
runs twice); when none can be, the answer is a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxllm.entrypoints.router.instances import Instance, InstancePool
from jaxllm.entrypoints.router.metrics import RouterMetrics, outcome_of

logger = logging.getLogger("jaxllm.router")

PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
# left out of the prefill request: streaming options, and what would contradict max_tokens 1
PREFILL_DROPPED_FIELDS = ("stream_options", "max_completion_tokens", "min_tokens")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
HEALTH_TIMEOUT_S = 5.0  # at most this long for an instance's /health (less when --timeout is shorter)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, one choice, not streamed, KV kept."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's request with the prefill's params (the router owns the field: a client's own is dropped)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's error shape, for what the router itself answers (the instances' errors pass through)."""
    return JSONResponse(error_body(status, message), status_code=status)


def describe(error: Exception) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@dataclass
class Prefilled:
    kv_transfer_params: dict[str, Any] | None = None
    rejection: Response | None = None  # a prefill 4xx, handed back instead of decoding


class Proxy:
    def __init__(
        self,
        prefill: InstancePool,
        decode: InstancePool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        *,
        health_timeout: float = HEALTH_TIMEOUT_S,
    ):
        self.prefill_pool, self.decode_pool = prefill, decode
        self.client, self.metrics = client, metrics
        self.health_timeout = health_timeout

    # ---- completions and chat completions ------------------------------------------------------

    async def completion(self, route: str, raw_body: bytes, headers: dict[str, str]) -> Response:
        """Both phases for one request; cancelling it (the client left) closes every upstream call."""
        start = time.perf_counter()
        try:
            body = json.loads(raw_body) if raw_body else None
        except ValueError as e:
            return self.metrics.finish(route, start, error_response(400, f"the request body is not valid JSON: {e}"))
        if not isinstance(body, dict):
            return self.metrics.finish(route, start, error_response(400, "the request body must be a JSON object"))
        headers = {**headers, "content-type": "application/json"}
        try:
            prefilled = await self.prefill(route, body, headers)
            if prefilled.rejection is not None:
                return self.metrics.finish(route, start, prefilled.rejection)
            return await self.decode(route, decode_body(body, prefilled.kv_transfer_params), headers, start)
        except asyncio.CancelledError:
            self.metrics.record(route, start, "aborted")
            raise

    async def prefill(self, route: str, body: dict[str, Any], headers: dict[str, str]) -> Prefilled:
        start = time.perf_counter()
        payload = json.dumps(prefill_body(body)).encode()
        errors = []
        for instance in self.prefill_pool.candidates():
            self.prefill_pool.acquire(instance)
            try:
                response = await self.client.post(instance.url + route, content=payload, headers=headers)
            except httpx.HTTPError as e:
                errors.append(self.failed(self.prefill_pool, instance, describe(e)))
                continue
            finally:
                self.prefill_pool.release(instance)
            if response.status_code >= 500:
                errors.append(self.failed(self.prefill_pool, instance, f"HTTP {response.status_code}"))
                continue
            self.prefill_pool.answered(instance)
            if response.status_code >= 400:
                return Prefilled(rejection=whole(response))
            try:
                answer = response.json()
            except ValueError:
                errors.append(self.failed(self.prefill_pool, instance, "answered 2xx without JSON"))
                continue
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            self.metrics.prefill_latency.observe(time.perf_counter() - start)
            return Prefilled(kv_transfer_params=params if isinstance(params, dict) else None)
        self.metrics.prefill_fallbacks.inc()
        logger.warning(
            "no prefill instance answered request %s (%s): a decode instance computes its prompt",
            headers.get("x-request-id"),
            "; ".join(errors),
        )
        return Prefilled()

    async def decode(self, route: str, body: dict[str, Any], headers: dict[str, str], start: float) -> Response:
        payload = json.dumps(body).encode()
        errors = []
        for instance in self.decode_pool.candidates():
            self.decode_pool.acquire(instance)
            request = self.client.build_request("POST", instance.url + route, content=payload, headers=headers)
            try:
                upstream = await self.client.send(request, stream=True)
            except BaseException as e:
                self.decode_pool.release(instance)
                if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):  # never reached it: try the next
                    errors.append(self.failed(self.decode_pool, instance, describe(e)))
                    continue
                if not isinstance(e, httpx.HTTPError):
                    raise
                status = 504 if isinstance(e, httpx.TimeoutException) else 502
                message = f"decode instance {self.failed(self.decode_pool, instance, describe(e))}"
                return self.metrics.finish(route, start, error_response(status, message))
            self.decode_pool.answered(instance)

            def close(outcome: str, instance: Instance = instance) -> None:
                self.decode_pool.release(instance)
                self.metrics.record(route, start, outcome)

            return PassthroughResponse(upstream, on_close=close)
        message = "no decode instance could be reached: " + "; ".join(errors)
        return self.metrics.finish(route, start, error_response(503, message), outcome="unavailable")

    # ---- everything else -------------------------------------------------------------------------

    async def forward_get(self, path: str, headers: dict[str, str]) -> Response:
        """A GET answered by a decode instance (`/v1/models`): the first one that can be reached."""
        errors = []
        for instance in self.decode_pool.candidates():
            try:
                response = await self.client.get(instance.url + path, headers=headers)
            except httpx.HTTPError as e:
                errors.append(self.failed(self.decode_pool, instance, describe(e)))
                continue
            self.decode_pool.answered(instance)
            return whole(response)
        return error_response(503, "no decode instance could be reached: " + "; ".join(errors))

    async def health(self) -> dict[str, dict[str, str]]:
        """Every instance's /health, asked at once: "ok" or what went wrong, by role and URL."""

        async def probe(pool: InstancePool, instance: Instance) -> str:
            try:
                response = await self.client.get(instance.url + "/health", timeout=self.health_timeout)
            except httpx.HTTPError as e:
                pool.failed(instance, describe(e))
                return describe(e)
            if response.status_code != 200:
                pool.failed(instance, f"HTTP {response.status_code}")
                return f"HTTP {response.status_code}"
            pool.answered(instance)
            return "ok"

        pools = (self.prefill_pool, self.decode_pool)
        probes = [(pool, instance) for pool in pools for instance in pool.instances]
        results = await asyncio.gather(*(probe(pool, instance) for pool, instance in probes))
        report: dict[str, dict[str, str]] = {pool.role: {} for pool in pools}
        for (pool, instance), result in zip(probes, results, strict=True):
            report[pool.role][instance.url] = result
        return report

    # ---- bookkeeping -----------------------------------------------------------------------------

    def failed(self, pool: InstancePool, instance: Instance, error: str) -> str:
        pool.failed(instance, error)
        self.metrics.upstream_errors.labels(pool.role, instance.url).inc()
        return f"{instance.url}: {error}"


def whole(response: httpx.Response) -> Response:
    """An instance's complete answer, handed back as it is."""
    return Response(response.content, status_code=response.status_code, media_type=response.headers.get("content-type"))


class PassthroughResponse(StreamingResponse):
    """A decode instance's answer, streamed back as its bytes arrive.

    However it ends (sent in full, broken upstream, or the client gone) the upstream response is
    closed, which drops the connection to an instance still generating: it aborts the request.
    """

    def __init__(self, upstream: httpx.Response, on_close: Callable[[str], None]):
        self.upstream = upstream
        self.on_close = on_close
        self.outcome = "aborted"  # until the last byte is out
        media_type = upstream.headers.get("content-type")
        self.is_sse = (media_type or "").startswith("text/event-stream")
        super().__init__(
            self._chunks(),
            status_code=upstream.status_code,
            headers=SSE_HEADERS if self.is_sse else None,
            media_type=media_type,
        )

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as e:
            self.outcome = "upstream_error"
            logger.warning("the decode instance at %s broke off its answer: %s", self.upstream.url, describe(e))
            if self.is_sse:  # the status is already sent: say so in the stream, as the servers do
                error = error_body(502, f"the decode instance broke off: {describe(e)}")
                yield f"data: {json.dumps(error)}\n\n".encode()
            return
        self.outcome = outcome_of(self.upstream.status_code)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # also when cancelled: the instance must see the close
                await self.upstream.aclose()
            self.on_close(self.outcome)

"""The FastAPI app: routes only. Each route parses its body, hands it to a serving_* object and
returns JSON or server-sent events; every failure becomes OpenAI's error JSON (errors.py)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.errors import OpenAIError, parse_request, status_error
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxllm.entrypoints.openai.serving_engine import convert_engine_errors
from jaxllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("jaxllm.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(
    engine: AsyncLLM,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    max_log_len: int | None = None,
) -> FastAPI:
    names = served_model_names or [engine.model_name]
    completion = OpenAIServingCompletion(engine, names, max_log_len)
    chat = OpenAIServingChat(engine, names, max_log_len)
    tokenization = OpenAIServingTokenization(chat)
    app = FastAPI(title="jaxllm OpenAI-compatible server", version=jaxllm.__version__)
    app.state.engine = engine

    # ---- errors: OpenAI's JSON everywhere ----------------------------------------------------

    @app.exception_handler(OpenAIError)
    async def openai_error(_, e: OpenAIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return status_error(e.status_code, str(e.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return OpenAIError(str(e.errors()[0].get("msg", e)), status=400).response()

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        return convert_engine_errors(e).response()

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    # ---- generation ------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def create_completion(raw: Request):
        body = parse_request(CompletionRequest, await raw.body())
        return await respond(raw, completion.create_completion(body, raw.headers.get("x-request-id")))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request):
        body = parse_request(ChatCompletionRequest, await raw.body())
        return await respond(raw, chat.create_chat_completion(body, raw.headers.get("x-request-id")))

    # ---- everything else --------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, root=engine.info.model, max_model_len=engine.info.max_model_len) for name in names]
        return ModelList(data=cards)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return tokenization.tokenize(parse_request(TokenizeRequest, await raw.body()))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return tokenization.detokenize(parse_request(DetokenizeRequest, await raw.body()))

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return OpenAIError("the engine is not running", status=503).response()
        if dead := engine.dead_engines():  # degraded: serving on the remaining data-parallel replicas
            return JSONResponse({"status": "degraded", "dead_engines": dead}, status_code=200)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxllm.__version__}

    @app.get("/metrics")
    async def metrics():
        engine.refresh_metrics()
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on /v1/*, as vLLM's --api-key (/health, /metrics stay open).

    A plain ASGI middleware: it must not wrap `receive`, which streams use to see disconnects.
    """

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self.authorized(scope):
            error = OpenAIError("Incorrect API key provided.", status=401, code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)


async def respond(raw: Request, work: Awaitable) -> Response:
    """Run a generation route; a client that leaves before the answer aborts its requests.

    Streams watch for the disconnect themselves (Starlette cancels a StreamingResponse's body);
    a plain response is raced against the connection here.
    """
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if handler not in done:  # the client left: cancelling the handler aborts its engine requests
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
        return Response(status_code=499)
    watcher.cancel()
    result = handler.result()
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(result.model_dump())


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass

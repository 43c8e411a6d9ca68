"""The FastAPI app: routes only. Each route reads its body (a 413 past the size limit), parses it,
hands it to a serving_* object and returns JSON or server-sent events; every failure becomes
OpenAI's error JSON (errors.py)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxllm
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.logger import RequestLogger
from jaxllm.entrypoints.openai.async_tokenizer import AsyncTokenizer
from jaxllm.entrypoints.openai.chat_templates import CHATML_TOOLS, load_chat_template
from jaxllm.entrypoints.openai.errors import OpenAIError, bad_request, parse_request, status_error
from jaxllm.entrypoints.openai.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelList,
    TokenizeRequest,
)
from jaxllm.entrypoints.openai.responses_protocol import ResponsesRequest
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from jaxllm.entrypoints.openai.serving_engine import ServingOptions, convert_engine_errors
from jaxllm.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    LoRAModulePath,
    OpenAIServingModels,
    UnloadLoRAAdapterRequest,
    runtime_lora_updating,
)
from jaxllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxllm.entrypoints.openai.serving_score import OpenAIServingScores
from jaxllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from jaxllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from jaxllm.entrypoints.openai.ui import add_ui_routes
from jaxllm.reasoning import REASONING_PARSERS
from jaxllm.weights.default import DEFAULT_MODEL_NAME

logger = logging.getLogger("jaxllm.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024  # --max-request-body-bytes
PARSE_OFF_LOOP_BYTES = 1024 * 1024  # larger bodies are parsed on a thread
M = TypeVar("M", bound=BaseModel)


def serving_options(
    engine: AsyncLLM, chat_template: str | None, enable_auto_tool_choice: bool, tool_call_parser: str | None
) -> ServingOptions:
    """The flags as the serving classes use them. The embedded default model (plain ChatML, no tool format)
    gets the shipped `chatml_tools` template for conversations with tools and the `hermes` parser."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser!r}: not one of {', '.join(TOOL_PARSERS)}")
    default_model = engine.info.model == DEFAULT_MODEL_NAME
    if default_model:
        enable_auto_tool_choice, tool_call_parser = True, tool_call_parser or "hermes"
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of: {', '.join(TOOL_PARSERS)})")
    reasoning = REASONING_PARSERS[engine.info.reasoning_parser] if engine.info.reasoning_parser else None
    return ServingOptions(
        chat_template=load_chat_template(chat_template),
        tools_chat_template=CHATML_TOOLS if default_model else None,
        tool_parser=tool_call_parser if enable_auto_tool_choice else None,
        reasoning=reasoning,
        reasoning_end_id=reasoning.token_ids(engine.tokenizer)[1] if reasoning is not None else None,
    )


def build_app(
    engine: AsyncLLM,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    enable_log_requests: bool = False,
    max_log_len: int | None = None,
    chat_template: str | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
    lora_modules: list[LoRAModulePath] | None = None,
    disable_ui: bool = False,
) -> FastAPI:
    """The app. `lora_modules` (--lora-modules) are loaded into the engine now: ValueError naming a bad one. With
    $JAXLLM_ALLOW_RUNTIME_LORA_UPDATING set, adapters can also be loaded and unloaded while serving. The chat
    page is at / and /ui unless `disable_ui` (--disable-ui)."""
    names = served_model_names or [engine.model_name]
    options = serving_options(engine, chat_template, enable_auto_tool_choice, tool_call_parser)
    models = OpenAIServingModels(engine, names)
    models.load_static(lora_modules or [])
    tokenizer = AsyncTokenizer(engine.tokenizer, engine.info.max_model_len)
    request_logger = RequestLogger(max_log_len=max_log_len) if enable_log_requests else None
    completion = OpenAIServingCompletion(
        engine, names, request_logger, options=options, tokenizer=tokenizer, models=models
    )
    chat = OpenAIServingChat(engine, names, request_logger, options=options, tokenizer=tokenizer, models=models)
    app = FastAPI(title="jaxllm OpenAI-compatible server", version=jaxllm.__version__)
    app.state.engine = engine
    app.state.openai_serving_completion, app.state.openai_serving_chat = completion, chat  # vLLM's names
    app.state.openai_serving_models = models
    add_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    parse = body_parser(max_request_body_bytes)
    if engine.info.runner == "pooling":  # generation routes answer 400 naming --runner
        add_refused_generation_routes(app)
    else:
        add_generation_routes(app, parse, completion, chat, OpenAIServingResponses(chat))
    pooling = dict(options=options, tokenizer=tokenizer, models=models)
    add_pooling_routes(
        app,
        parse,
        OpenAIServingEmbedding(engine, names, request_logger, **pooling),  # type: ignore[arg-type]
        OpenAIServingScores(engine, names, request_logger, **pooling),  # type: ignore[arg-type]
    )
    add_info_routes(app, parse, engine, models, OpenAIServingTokenization(chat))
    if runtime_lora_updating():
        add_lora_routes(app, parse, models)
    if not disable_ui:
        add_ui_routes(app)
    return app


class Parse(Protocol):
    """A route's body parser (`body_parser`)."""

    def __call__(self, model: type[M], raw: Request) -> Awaitable[M]: ...


def body_parser(max_request_body_bytes: int | None) -> Parse:
    """Reads a request's body (a 413 past the limit) and parses it; a large body is parsed on a thread."""

    async def parse(model: type[M], raw: Request) -> M:
        body = await read_body(raw, max_request_body_bytes)
        if len(body) > PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse_request, model, body)
        return parse_request(model, body)

    return parse


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI's error JSON for every failure."""

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


def add_generation_routes(
    app: FastAPI,
    parse: Parse,
    completion: OpenAIServingCompletion,
    chat: OpenAIServingChat,
    responses: OpenAIServingResponses,
) -> None:
    """/v1/completions, /v1/chat/completions, /v1/responses: JSON or server-sent events."""

    @app.post("/v1/completions")
    async def create_completion(raw: Request):
        body = await parse(CompletionRequest, raw)
        return await respond(raw, completion.create_completion(body, request_id(raw, body)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request):
        body = await parse(ChatCompletionRequest, raw)
        return await respond(raw, chat.create_chat_completion(body, request_id(raw, body)))

    @app.post("/v1/responses")
    async def create_response(raw: Request):
        body = await parse(ResponsesRequest, raw)
        return await respond(raw, responses.create_response(body, request_id(raw, body)))


def add_refused_generation_routes(app: FastAPI) -> None:
    """A pooling server (--runner pooling) serves no tokens: the generation routes are a 400 that says so."""

    async def refuse(raw: Request):
        raise bad_request(
            "this server runs --runner pooling (embeddings, /score, /rerank): generation needs --runner generate"
        )

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        app.add_api_route(path, refuse, methods=["POST"])


def add_pooling_routes(app: FastAPI, parse: Parse, embedding: OpenAIServingEmbedding, scores: OpenAIServingScores):
    """/v1/embeddings (OpenAI's), /score and /v1/score (vLLM's), /rerank, /v1/rerank, /v2/rerank (Jina's and
    Cohere's); a generate server answers them with a 400 naming --runner pooling."""

    @app.post("/v1/embeddings")
    async def create_embedding(raw: Request):
        body = await parse(EmbeddingRequest, raw)
        return await respond(raw, embedding.create_embedding(body, request_id(raw, body)))

    async def create_score(raw: Request):
        body = await parse(ScoreRequest, raw)
        return await respond(raw, scores.create_score(body, request_id(raw, body)))

    async def do_rerank(raw: Request):
        body = await parse(RerankRequest, raw)
        return await respond(raw, scores.do_rerank(body, request_id(raw, body)))

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, create_score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, do_rerank, methods=["POST"])


def add_info_routes(
    app: FastAPI,
    parse: Parse,
    engine: AsyncLLM,
    models: OpenAIServingModels,
    tokenization: OpenAIServingTokenization,
) -> None:
    """Everything but generation: models, (de)tokenization, health, version, metrics."""

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return models.show_available_models()

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await tokenization.tokenize(await parse(TokenizeRequest, raw))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await tokenization.detokenize(await parse(DetokenizeRequest, raw))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenization.tokenizer_info()

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return OpenAIError("the engine is not running", status=503).response()
        if dead := engine.dead_engines():  # degraded: serving on the remaining data-parallel replicas
            return JSONResponse({"status": "degraded", "dead_engines": dead}, status_code=200)
        return Response(status_code=200)

    @app.get("/v1/kv_cache_info")
    async def kv_cache_info():
        """What a cache-aware router needs to hash prompts as this engine does, and where its KV events are."""
        info = engine.info
        return {"block_size": info.block_size, "kv_scope_root": info.kv_scope_root, "kv_events": info.kv_events}

    @app.get("/version")
    async def version():
        return {"version": jaxllm.__version__}

    @app.get("/metrics")
    async def metrics():
        engine.refresh_metrics()
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def add_lora_routes(app: FastAPI, parse: Parse, models: OpenAIServingModels) -> None:
    """vLLM's runtime adapter routes (only with $JAXLLM_ALLOW_RUNTIME_LORA_UPDATING): 200 and a plain message;
    400 for an adapter the engine refuses or a name in use, 404 for unloading an unknown one."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        message = await models.load_lora_adapter(await parse(LoadLoRAAdapterRequest, raw))
        return PlainTextResponse(message)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        message = await models.unload_lora_adapter(await parse(UnloadLoRAAdapterRequest, raw))
        return PlainTextResponse(message)


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on /v1/*, as vLLM's --api-key (/health, /metrics and the chat page stay open:
    the page asks for the key when its first API call gets this 401).

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


async def read_body(raw: Request, limit: int | None) -> bytes:
    """The request body; a 413 when it is larger than `limit` bytes.

    An oversized body is refused by its Content-Length before any of it is kept; the rest is still
    read and dropped (up to 8x the limit), so the client gets the 413 rather than a broken pipe.
    """
    declared = raw.headers.get("content-length", "")
    too_big = limit is not None and declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    async for chunk in raw.stream():
        size += len(chunk)
        if limit is not None and size > limit:
            too_big = True
            if size > 8 * limit:
                break
        if not too_big:
            chunks.append(chunk)
    if too_big:
        raise OpenAIError(
            f"the request body is larger than this server's limit of {limit} bytes (--max-request-body-bytes)",
            status=413,
            code="request_too_large",
        )
    return b"".join(chunks)


def request_id(raw: Request, body) -> str | None:
    """The client's request id: the X-Request-Id header, else vLLM's `request_id` field."""
    return raw.headers.get("x-request-id") or body.request_id


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
    return JSONResponse(result if isinstance(result, dict) else result.model_dump())


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass

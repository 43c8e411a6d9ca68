"""POST /v1/embeddings (OpenAI's): inputs → prompts → `AsyncLLM.encode`, all in flight at once so the scheduler
batches them; the response in OpenAI's shape, floats or base64 (little-endian float32, as OpenAI's SDK decodes).
Translation only: pooling, truncation to `dimensions` and normalisation are the engine's."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.pooling_protocol import EmbeddingRequest
from jaxllm.entrypoints.openai.serving_engine import OpenAIServing
from jaxllm.outputs import EmbeddingRequestOutput
from jaxllm.pooling.config import check_dimensions
from jaxllm.pooling.params import PoolingParams


class OpenAIServingPooling(OpenAIServing):
    """What the pooling routes share: the runner check, prompts as token ids, and embedding them together."""

    def check_pooling(self, model: str | None) -> None:
        self.check_model(model)
        self.check_engine()
        if self.engine.info.runner != "pooling":
            raise bad_request(
                "this server runs --runner generate: embeddings, /score and /rerank need --runner pooling"
            )

    async def token_ids(self, item: str | list[int], param: str, request) -> list[int]:
        if isinstance(item, str):
            if self.engine.tokenizer is None:
                raise bad_request("this model has no tokenizer: send token ids", param=param)
            ids = await self.tokenizing.encode(item)
        else:
            ids = list(item)
        ids = self.truncate(ids, request)
        if not ids:
            raise bad_request(f"{param}: an input is empty", param=param)
        self.check_prompt(ids, param)
        return ids

    async def embed_all(
        self, prompts: list[list[int]], params: PoolingParams, request_id: str, user: str | None = None
    ) -> list[EmbeddingRequestOutput]:
        """Every prompt's embedding, submitted together (one engine request each, batched by the scheduler)."""

        async def one(i: int, ids: list[int]) -> EmbeddingRequestOutput:
            async for out in self.engine.encode({"prompt_token_ids": ids}, params, f"{request_id}-{i}", user=user):
                return out
            raise RuntimeError("the engine gave no embedding")

        return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))


class OpenAIServingEmbedding(OpenAIServingPooling):
    async def create_embedding(self, request: EmbeddingRequest, request_id: str | None = None) -> dict:
        self.check_pooling(request.model)
        items = _inputs(request.input)
        prompts = [await self.token_ids(item, "input", request) for item in items]
        try:
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
            check_dimensions(self.engine.info.pooler, request.dimensions, self.engine.info.hidden_size)
        except ValueError as e:
            raise bad_request(str(e), param="dimensions") from None
        request_id = request_id or f"embd-{uuid.uuid4().hex}"
        outputs = await self.embed_all(prompts, params, request_id, request.user)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(out.outputs.embedding, request.encoding_format)}
            for i, out in enumerate(outputs)
        ]
        tokens = sum(len(p) for p in prompts)
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": self.model_name(request),
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _inputs(value) -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        items: list = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [list(value)]
    else:
        items = list(value)
    if not items:
        raise bad_request("input must not be empty", param="input")
    for item in items:
        if isinstance(item, str) and not item:
            raise bad_request("input must not contain an empty string", param="input")
    return items


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, "<f4").tobytes()).decode()
    return embedding

"""POST /score (vLLM's shape) and /rerank (Jina's and Cohere's): texts → embeddings (`AsyncLLM.encode`, batched
together) → cosine similarities, the score of an embedding model as vLLM computes it. Translation only."""

from __future__ import annotations

import time
import uuid

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.pooling_protocol import RerankRequest, ScoreRequest
from jaxllm.entrypoints.openai.serving_embedding import OpenAIServingPooling
from jaxllm.pooling.params import PoolingParams
from jaxllm.pooling.score import cosine, pair_up


class OpenAIServingScores(OpenAIServingPooling):
    async def _scores(self, first: list[str], second: list[str], request, request_id: str, param: str):
        """(cosine of each pair, prompt tokens in all)."""
        try:
            pairs = pair_up(first, second)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None
        prompts = [await self.token_ids(text, param, request) for text in first + second]
        outputs = await self.embed_all(prompts, PoolingParams(), request_id)
        a, b = outputs[: len(first)], outputs[len(first) :]
        scores = [cosine(a[i].outputs.embedding, b[j].outputs.embedding) for i, j in pairs]
        return scores, sum(len(p) for p in prompts)

    async def create_score(self, request: ScoreRequest, request_id: str | None = None) -> dict:
        self.check_pooling(request.model)
        first = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        second = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        request_id = request_id or f"score-{uuid.uuid4().hex}"
        scores, tokens = await self._scores(first, second, request, request_id, "text_1")
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": self.model_name(request),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def do_rerank(self, request: RerankRequest, request_id: str | None = None) -> dict:
        self.check_pooling(request.model)
        if request.top_n is not None and request.top_n < 1:
            raise bad_request(f"top_n must be at least 1, got {request.top_n}", param="top_n")
        texts = [d if isinstance(d, str) else d.text for d in request.documents]
        request_id = request_id or f"rerank-{uuid.uuid4().hex}"
        scores, tokens = await self._scores([request.query], texts, request, request_id, "documents")
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: request.top_n or len(texts)]
        results = []
        for i in order:
            result: dict = {"index": i, "relevance_score": scores[i]}
            if request.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return {
            "id": request_id,
            "model": self.model_name(request),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }

"""Request bodies of the pooling routes: OpenAI's /v1/embeddings, vLLM's /score, Jina's and Cohere's /rerank."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from jaxllm.entrypoints.openai.protocol import RequestModel

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka-trained models only (a 400 otherwise)
    user: str | None = None
    normalize: bool | None = None  # vLLM's extra: None is the pooler's own setting
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the last N tokens (-1: max_model_len)
    request_id: str | None = None


class ScoreRequest(RequestModel):
    """vLLM's /score: one text_1 against each text_2, or text_1[i] against text_2[i]."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None


class RerankDocument(RequestModel):
    text: str


class RerankRequest(RequestModel):
    """Jina's and Cohere's /rerank (v1 and v2): documents as strings or {"text": ...}, the top_n best first."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None

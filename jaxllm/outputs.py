"""What generation returns: RequestOutput / CompletionOutput, as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request failed, when finish_reason is "error"
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token id: Logprob} per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # what the KV connector says about this request (P/D producer: where its KV waits for the consumer)
    kv_transfer_params: dict | None = None
    refused: bool = False  # the engine refused it as it arrived (bad input): `error` says why
    # the pooling runner: the finished request's embedding (LLM.embed and AsyncLLM.encode hand it on as an
    # EmbeddingRequestOutput; inside the engine it rides here, so metrics and clients see one output type)
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """A pooling request's result (vLLM's name): `outputs.embedding`, the prompt's token ids."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None  # why the request failed (its embedding is then empty)
    refused: bool = False  # the engine refused it as it arrived (bad input)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (vLLM's name): `outputs.score`, the cosine of the two embeddings for an embedding model."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

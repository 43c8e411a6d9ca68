"""Request and response bodies of the OpenAI API (and vLLM's extra fields), as pydantic models.

Requests are parsed strictly from JSON (`parse_request`): a wrong type is a 400 naming the
field, never a silent coercion. Unknown fields are ignored, as OpenAI and vLLM do, with a WARNING
line naming them (a typo such as `temprature` would otherwise change nothing unseen); a field
OpenAI or vLLM defines is honoured, or refused with a 400 naming it (unsupported.py), never
accepted and ignored. Ranges are checked where the request becomes `SamplingParams` (serving_*.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger("jaxllm.server")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests ---------------------------------------------------------------------------------


class RequestModel(OpenAIModel):
    """A request body or a part of one: fields it does not define are ignored, and logged (vLLM's warning)."""

    _known: ClassVar[dict[type, frozenset[str]]] = {}

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data, handler):
        if isinstance(data, dict):
            known = cls._known.get(cls)
            if known is None:
                names = {name for field, info in cls.model_fields.items() for name in (field, info.alias) if name}
                known = cls._known[cls] = frozenset(names)
            if ignored := [key for key in data if key not in known]:
                logger.warning(
                    "The following fields were present in the request but ignored: %s (%s)",
                    sorted(ignored),
                    cls.__name__,
                )
        return handler(data)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingRequest(RequestModel):
    """Fields both generation endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # default 1.0
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    request_id: str | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: max_model_len)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    # structured outputs (jaxllm/structured/openai_fields.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names for structured_outputs' keys
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI's fields that do not change the output: accepted
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens (not with stream)
    # vLLM's: what the KV connector is told (P/D: jaxllm router sets it; docs/disaggregated.md)
    kv_transfer_params: dict[str, Any] | None = None
    # known fields refused unless left at their default (unsupported.py)
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    return_token_ids: Any = None
    cache_salt: Any = None
    vllm_xargs: Any = None
    structural_tag: Any = None
    store: Any = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None  # refused (unsupported.py)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # an assistant turn's thinking, under either name clients send it (the template reads `reasoning_content`)
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat extras
    echo: bool = False  # start the reply with the last message's content when it is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    include_reasoning: bool = True  # vLLM's: false drops a reasoning model's thinking from the reply
    documents: list[dict[str, Any]] | None = None  # for templates that take them (RAG)
    add_special_tokens: bool = False
    # OpenAI's fields that do not change the output: accepted
    prediction: dict[str, Any] | None = None  # predicted output: a latency hint only
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None  # ["text"] only (unsupported.py)
    # known fields refused (unsupported.py)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    mm_processor_kwargs: Any = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: dict[str, int] | None = None  # {"reasoning_tokens": N} from a reasoning model


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's extra


class PromptLogprob(OpenAIModel):
    """vLLM's entry of `prompt_logprobs`: a token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a P/D producer's answer (where its KV waits)


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # a reasoning model's thinking, under both names clients read (vLLM's older and newer)
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's extra
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a P/D producer's answer (where its KV waits)


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # as ChatResponseMessage's: both names, the same text
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

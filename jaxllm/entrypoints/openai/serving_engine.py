"""What the endpoints share: the server's options, model and field checks, the sampling fields,
the token budget, request logging, merging several streams, server-sent events and usage counts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError
from jaxllm.entrypoints.logger import RequestLogger
from jaxllm.entrypoints.openai.async_tokenizer import AsyncTokenizer
from jaxllm.entrypoints.openai.errors import OpenAIError, bad_request, from_value_error
from jaxllm.entrypoints.openai.protocol import PromptLogprob, SamplingRequest, UsageInfo
from jaxllm.entrypoints.openai.serving_models import OpenAIServingModels, model_not_found
from jaxllm.entrypoints.openai.unsupported import refuse_unsupported
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.reasoning import ReasoningSyntax
from jaxllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxllm.structured.openai_fields import OutputConstraint, RequestFieldError, output_constraint

logger = logging.getLogger("jaxllm.server")

_DONE = object()


@dataclass(frozen=True)
class ServingOptions:
    """Server-wide settings from `jaxllm serve`'s flags, shared by every endpoint."""

    chat_template: str | None = None  # --chat-template: replaces the model's own template
    tools_chat_template: str | None = None  # for conversations with tools when the model's template has no tools
    tool_parser: str | None = None  # reads calls back under tool_choice "auto" (--tool-call-parser)
    reasoning: ReasoningSyntax | None = None  # tells thinking from the answer (the engine's --reasoning-parser)
    reasoning_end_id: int | None = None  # the end tag's token: counts reasoning_tokens


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        request_logger: RequestLogger | None = None,
        *,
        options: ServingOptions | None = None,
        tokenizer: AsyncTokenizer | None = None,
        models: OpenAIServingModels | None = None,
    ):
        self.engine = engine
        self.served_model_names = served_model_names
        self.models = models  # the base model's names and the LoRA adapters (None: the base model's names only)
        self.request_logger = request_logger  # None: requests are not logged (no --enable-log-requests)
        self.max_model_len = engine.info.max_model_len
        self.options = options or ServingOptions()
        self.tokenizing = tokenizer or AsyncTokenizer(engine.tokenizer, self.max_model_len)

    def model_name(self, request) -> str:
        return request.model or self.served_model_names[0]

    # ---- checks ------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if self.models is not None:
            self.models.check_model(model)
        elif model is not None and model not in self.served_model_names:
            raise model_not_found(model)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); a 404 for an unknown model."""
        if self.models is not None:
            return self.models.lora_request(model)
        self.check_model(model)
        return None

    def check_engine(self) -> None:
        try:
            self.engine.check_health()
        except EngineDeadError as e:
            raise OpenAIError(str(e), status=503) from None

    def check_request(self, request) -> None:
        """What every generation request must pass before any work: its model, a live engine, no refused field."""
        self.check_model(request.model)
        self.check_engine()
        refuse_unsupported(request)

    def truncate(self, token_ids: list[int], request) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: keep the prompt's last N tokens (-1: max_model_len)."""
        keep = getattr(request, "truncate_prompt_tokens", None)
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len
        if keep < 1:
            raise bad_request(f"truncate_prompt_tokens must be -1 or at least 1, got {keep}", "truncate_prompt_tokens")
        return token_ids[-keep:]

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        try:
            self.engine.info.validate_prompt(token_ids)
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param=param) from None

    def token_budget(self, max_tokens: int | None, prompt_len: int, param: str, *, allow_zero: bool = False) -> int:
        """vLLM's rule: prompt + completion must fit max_model_len; no max_tokens means all that is left.
        `allow_zero`: 0 asks for the prompt alone (completions with echo)."""
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            if room < 1:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens, and the "
                    f"prompt has {prompt_len}: no room is left for the completion.",
                    param=param,
                )
            return room
        if max_tokens < (0 if allow_zero else 1):
            at_least = "0 (with echo)" if allow_zero else "1 (0 only with echo, on /v1/completions)"
            raise bad_request(f"{param} must be at least {at_least}, got {max_tokens}", param=param)
        if max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or completion.",
                param=param,
            )
        return max_tokens

    # ---- request → SamplingParams --------------------------------------------------------------

    @staticmethod
    def output_constraint(request) -> OutputConstraint:
        """`response_format` / `structured_outputs` / forced `tools` → the output constraint (a 400 if bad)."""
        try:
            return output_constraint(request)
        except RequestFieldError as e:
            raise bad_request(str(e), param=e.param) from None

    def sampling_params(
        self,
        request: SamplingRequest,
        *,
        max_tokens: int,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The fields both endpoints share; range errors name the request field."""
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        limit = self.engine.info.max_num_seqs
        if request.n > limit:
            raise bad_request(
                f"n must be at most {limit} (max_num_seqs: a request's samples run together), got {request.n}",
                param="n",
            )
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
        stop_ids = request.stop_token_ids or []
        vocab = self.engine.info.vocab_size
        if request.prompt_logprobs is not None and request.stream:
            raise bad_request("prompt_logprobs is not available with stream", param="prompt_logprobs")
        bias = request.logit_bias or None
        if bias and any(not str(t).isdigit() or int(t) >= vocab for t in bias):
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        if any(not 0 <= t < vocab for t in stop_ids):
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
        try:
            return SamplingParams(
                n=request.n,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=request.top_k or 0,
                min_p=request.min_p or 0.0,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=stop_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else request.prompt_logprobs,
                logit_bias={int(t): v for t, v in bias.items()} if bias else None,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
                structured_outputs=structured_outputs,
                extra_args={"kv_transfer_params": request.kv_transfer_params} if request.kv_transfer_params else None,
            )
        except ValueError as e:
            raise from_value_error(e) from None

    # ---- running -------------------------------------------------------------------------------

    def generate_all(
        self,
        request_id: str,
        prompts: list[dict],
        params: list[SamplingParams],
        priority: int,
        user: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """One engine request per prompt (with `lora_request`'s adapter), merged: yields (prompt index, output) as
        they come."""
        if self.request_logger is not None:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                self.request_logger.log_inputs(f"{request_id}-{i}", prompt.get("prompt"), prompt["prompt_token_ids"], p)
        streams = [
            self.engine.generate(
                prompt, p, f"{request_id}-{i}", priority=priority, user=user, lora_request=lora_request
            )
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        return merge_async_iterators(streams)


async def last_output(outputs) -> RequestOutput:
    """The final output of a one-prompt request's stream of (index, output), an async generator (closed on the way
    out); an engine error is raised as its OpenAI error."""
    final = None
    async with aclosing(outputs):
        async for _, out in outputs:
            if (error := engine_error(out)) is not None:
                raise error
            final = out
    if final is None:
        raise RuntimeError("the engine ended the request without an output")
    return final


def prompt_logprobs_json(out: RequestOutput) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` of a response (None when not asked for)."""
    if out.prompt_logprobs is None:
        return None
    return [
        None if entry is None else {t: PromptLogprob(**dataclasses.asdict(lp)) for t, lp in entry.items()}
        for entry in out.prompt_logprobs
    ]


async def merge_async_iterators(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Items of all iterators as they arrive, tagged with the iterator's index.

    Closing the merged iterator (a client that left) cancels every source, which aborts
    their engine requests; an exception in a source ends the merge with that exception.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, iterator: AsyncIterator) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _DONE))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(out: RequestOutput) -> OpenAIError | None:
    """A request the engine failed (finish_reason "error") is the server's fault: a 500 saying why. One the engine
    refused as it arrived (`refused`: a ValueError from `add_request`) is the request's own: a 400, as the
    server's own checks give."""
    if out.error or any(c.finish_reason == "error" for c in out.outputs):
        if out.refused:
            return OpenAIError(f"the engine refused this request: {out.error}", status=400)
        return OpenAIError(f"the engine failed this request: {out.error or 'unknown error'}", status=500)
    return None


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> UsageInfo:
    """OpenAI's usage; `reasoning_tokens` (a reasoning model's thinking) goes in completion_tokens_details."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens_details=None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens},
    )


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def convert_engine_errors(e: Exception) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), status=503)
    if isinstance(e, ValueError):
        return from_value_error(e)
    logger.exception("request failed")
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500)

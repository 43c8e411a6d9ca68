"""POST /v1/completions: prompts (text, token ids, or lists of either) → completions, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import cast

from jaxllm.entrypoints.openai.errors import bad_request, not_supported
from jaxllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from jaxllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    convert_engine_errors,
    engine_error,
    prompt_logprobs_json,
    sse,
    usage,
)
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, request_id: str | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        """The response, or (stream=True) the server-sent events. Request errors raise before anything runs."""
        self.check_request(request)
        prompts = await self.prompts(request)
        constraint = self.output_constraint(request).params
        params = [self.completion_sampling_params(request, len(p["prompt_token_ids"]), constraint) for p in prompts]
        request_id = request_id or random_id("cmpl")
        lora = self.lora_request(request.model)
        outputs = self.generate_all(request_id, prompts, params, request.priority, request.user, lora)
        if request.stream:
            return self.stream(request, request_id, prompts, outputs)
        return await self.full_response(request, request_id, prompts, outputs)

    def completion_sampling_params(
        self, request: CompletionRequest, prompt_len: int, structured_outputs: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        """The request's SamplingParams for a prompt of `prompt_len` tokens."""
        if request.suffix is not None:
            raise not_supported("suffix")
        max_tokens = self.token_budget(request.max_tokens, prompt_len, "max_tokens", allow_zero=request.echo)
        scores_prompt = request.echo and request.logprobs is not None  # the prompt's logprobs are echoed too
        return self.sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=request.logprobs,
            structured_outputs=structured_outputs,
            prompt_logprobs=max(request.logprobs or 0, request.prompt_logprobs or 0) if scores_prompt else None,
        )

    def choice_logprobs(
        self, request: CompletionRequest, out: RequestOutput, c: CompletionOutput, offset: int, echoed: bool = True
    ) -> CompletionLogProbs | None:
        """The legacy logprobs of a choice's new tokens, text offsets from `offset`; with echo, the echoed
        prompt's tokens first (their logprobs from prompt_logprobs, the first one null)."""
        if request.logprobs is None:
            return None
        as_ids = request.return_tokens_as_token_ids
        if not (request.echo and echoed):
            return completion_logprobs(c, offset, as_ids)[0]
        prompt = _echoed_prompt_logprobs(out, self.engine.tokenizer, request.logprobs, as_ids)
        end = prompt.text_offset[-1] + len(prompt.tokens[-1]) if prompt.tokens and not as_ids else len(out.prompt or "")
        completion = completion_logprobs(c, end, as_ids)[0]
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(prompt, name).extend(getattr(completion, name))
        return prompt

    async def prompts(self, request: CompletionRequest) -> list[dict]:
        """Every prompt as {"prompt": text, "prompt_token_ids": ids}, checked against the model's limits.

        A text too long to fit is refused before it is tokenized; a long one is tokenized off the event loop.
        """
        raw: list[str] | list[list[int]]
        if isinstance(request.prompt, str):
            raw = [request.prompt]
        elif request.prompt and isinstance(request.prompt[0], int):
            raw = [cast(list[int], request.prompt)]  # one prompt of token ids (mypy cannot narrow by an item)
        else:
            raw = cast(list[str] | list[list[int]], request.prompt)
        if not raw:
            raise bad_request("prompt must not be empty", param="prompt")
        tokenizer = self.engine.tokenizer
        params = ["prompt" if len(raw) == 1 else f"prompt.{i}" for i in range(len(raw))]
        for item, param in zip(raw, params, strict=True):  # every prompt checked before any is tokenized
            if isinstance(item, str):
                if tokenizer is None:
                    raise bad_request("this model has no tokenizer: send token ids", param=param)
                if request.truncate_prompt_tokens is None:
                    self.tokenizing.check_length(len(item), param)
        prompts = []
        for item, param in zip(raw, params, strict=True):
            text: str | None = None
            if isinstance(item, str):
                ids, text = await self.tokenizing.encode(item, request.add_special_tokens), item
            else:
                ids = cast(list[int], list(item))
            ids = self.truncate(ids, request)
            self.check_prompt(ids, param)
            if request.echo and tokenizer is not None and (text is None or request.truncate_prompt_tokens is not None):
                text = await self.tokenizing.decode(ids)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return prompts

    async def full_response(self, request, request_id, prompts, outputs) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async with aclosing(outputs):
            async for i, out in outputs:
                if (error := engine_error(out)) is not None:
                    raise error
                finals[i] = out
        choices, generated = [], 0
        for i, out in enumerate(finals):
            if out is None:
                raise RuntimeError(f"prompt {i}: the engine ended its request without an output")
            echo = (out.prompt or "") if request.echo else ""
            for c in out.outputs:
                generated += len(c.token_ids)
                choices.append(
                    CompletionChoice(
                        index=i * request.n + c.index,
                        text=echo + c.text,
                        logprobs=self.choice_logprobs(request, out, c, 0),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_logprobs_json(out) if request.prompt_logprobs is not None else None,
                    )
                )
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        return CompletionResponse(
            id=request_id,
            model=self.model_name(request),
            choices=choices,
            usage=usage(prompt_tokens, generated),
            kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 and finals[0] is not None else None,
        )

    async def stream(self, request, request_id, prompts, outputs) -> AsyncIterator[str]:
        n, model = request.n, self.model_name(request)
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        generated = [0] * (len(prompts) * n)
        offsets: list[int | None] = [None] * (len(prompts) * n)  # characters streamed per choice; None: nothing yet
        first = CompletionResponse(id=request_id, model=model, choices=[])
        try:
            async with aclosing(outputs):
                async for i, out in outputs:
                    if (error := engine_error(out)) is not None:
                        yield error.sse()
                        break
                    for c in out.outputs:
                        index = i * n + c.index
                        text = c.text
                        offset = offsets[index]
                        if offset is None:
                            offset = 0
                            if request.echo:
                                text = (out.prompt or "") + text
                        logprobs = self.choice_logprobs(request, out, c, offset, echoed=len(text) > len(c.text))
                        offsets[index] = offset + len(text)
                        generated[index] += len(c.token_ids)
                        chunk = CompletionResponse(
                            id=request_id,
                            created=first.created,
                            model=model,
                            choices=[
                                CompletionChoice(
                                    index=index,
                                    text=text,
                                    logprobs=logprobs,
                                    finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason,
                                )
                            ],
                            usage=usage(prompt_tokens, sum(generated)) if continuous else None,
                        )
                        yield sse(chunk)
            if include_usage:
                yield sse(
                    CompletionResponse(
                        id=request_id,
                        created=first.created,
                        model=model,
                        choices=[],
                        usage=usage(prompt_tokens, sum(generated)),
                    )
                )
        except Exception as e:
            yield convert_engine_errors(e).sse()
        yield SSE_DONE


def _echoed_prompt_logprobs(out: RequestOutput, tokenizer, k: int, as_token_ids: bool) -> CompletionLogProbs:
    """The legacy logprobs of the echoed prompt: null for its first token, then each token's and the top k."""
    result = CompletionLogProbs()
    offset = 0
    for position, token in enumerate(out.prompt_token_ids):
        entry = out.prompt_logprobs[position] if out.prompt_logprobs else None
        if entry is None:
            text = tokenizer.decode([token]) if tokenizer is not None else ""
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            text = entry[token].decoded_token or ""
            result.token_logprobs.append(entry[token].logprob)
            top = sorted(entry.items(), key=lambda item: item[1].rank)[: max(k, 1)]
            result.top_logprobs.append(
                {(f"token_id:{t}" if as_token_ids else e.decoded_token or ""): e.logprob for t, e in top}
            )
        result.tokens.append(f"token_id:{token}" if as_token_ids else text)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def completion_logprobs(c: CompletionOutput, offset: int, as_token_ids: bool = False) -> tuple[CompletionLogProbs, int]:
    """OpenAI's legacy logprobs of `c`'s tokens, text offsets counted from `offset`.

    `as_token_ids` (vLLM's return_tokens_as_token_ids) names each token "token_id:N" instead of its text.
    """
    result = CompletionLogProbs()
    for token, entries in zip(c.token_ids, c.logprobs or [], strict=True):
        chosen: Logprob = entries[token]
        text = chosen.decoded_token or ""
        result.tokens.append(f"token_id:{token}" if as_token_ids else text)
        result.token_logprobs.append(chosen.logprob)
        result.top_logprobs.append(
            {(f"token_id:{t}" if as_token_ids else e.decoded_token or ""): e.logprob for t, e in entries.items()}
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result, offset

"""POST /v1/chat/completions: messages through the model's chat template → a reply, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from jaxllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    convert_engine_errors,
    engine_error,
    sse,
    usage,
)
from jaxllm.outputs import CompletionOutput
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams
from jaxllm.structured.openai_fields import ForcedToolCall


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, request_id: str | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or (stream=True) the server-sent events. Request errors raise before anything runs."""
        self.check_model(request.model)
        self.check_engine()
        prompt = self.render(request)
        constraint = self.output_constraint(request)
        params = self.chat_sampling_params(request, len(prompt["prompt_token_ids"]), constraint.params)
        request_id = request_id or random_id("chatcmpl")
        outputs = self.generate_all(request_id, [prompt], [params], request.priority, request.user)
        echo = self.echo_text(request)
        if request.stream:
            return self.stream(request, request_id, prompt, outputs, echo, constraint.tool_call)
        return await self.full_response(request, request_id, prompt, outputs, echo, constraint.tool_call)

    def chat_sampling_params(
        self, request: ChatCompletionRequest, prompt_len: int, structured_outputs: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        """The request's SamplingParams for a rendered conversation of `prompt_len` tokens."""
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.max_completion_tokens is not None:
            max_tokens = self.token_budget(request.max_completion_tokens, prompt_len, "max_completion_tokens")
        else:
            max_tokens = self.token_budget(request.max_tokens, prompt_len, "max_tokens")
        return self.sampling_params(
            request, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured_outputs
        )

    def render(self, request: ChatCompletionRequest) -> dict:
        """The conversation through the chat template: {"prompt": text, "prompt_token_ids": ids}."""
        if not request.messages:
            raise bad_request("messages must be a non-empty list", param="messages")
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template and request.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        if request.continue_final_message and request.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
            )
        messages = [message_dict(m) for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template,
                tools=request.tools,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as e:  # a template that rejects the conversation (roles out of order, ...)
            raise bad_request(f"the chat template failed on these messages: {e}", param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        self.check_prompt(ids, "messages")
        return {"prompt": text, "prompt_token_ids": ids}

    @staticmethod
    def echo_text(request: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the reply starts with the last message's text when it is the assistant's."""
        last = request.messages[-1]
        if request.echo and last.role == "assistant":
            return message_dict(last)["content"]
        return ""

    async def full_response(
        self, request, request_id, prompt, outputs, echo, tool_call: ForcedToolCall | None = None
    ) -> ChatCompletionResponse:
        final = None
        async with aclosing(outputs):
            async for _, out in outputs:
                if (error := engine_error(out)) is not None:
                    raise error
                final = out
        if final is None:
            raise RuntimeError("the engine ended the request without an output")
        choices = []
        for c in final.outputs:
            calls, finish_reason = read_tool_calls(tool_call, c.text, c.finish_reason)
            message = (
                ChatResponseMessage(content=None, tool_calls=calls)
                if calls
                else ChatResponseMessage(content=echo + c.text)
            )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=chat_logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                )
            )
        generated = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name(request),
            choices=choices,
            usage=usage(len(prompt["prompt_token_ids"]), generated),
        )

    async def stream(
        self, request, request_id, prompt, outputs, echo, tool_call: ForcedToolCall | None = None
    ) -> AsyncIterator[str]:
        model = self.model_name(request)
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats
        prompt_tokens = len(prompt["prompt_token_ids"])
        generated = [0] * request.n
        texts = [""] * request.n  # a forced tool call's text, read back as tool_calls when it ends
        head = ChatCompletionChunk(id=request_id, created=int(time.time()), model=model, choices=[])

        def chunk(choices, usage_info=None) -> str:
            return sse(head.model_copy(update={"choices": choices, "usage": usage_info}))

        try:
            # every choice opens with the role, as OpenAI's stream does
            yield chunk(
                [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=echo)) for i in range(request.n)]
            )
            async with aclosing(outputs):
                async for _, out in outputs:
                    if (error := engine_error(out)) is not None:
                        yield error.sse()
                        break
                    for c in out.outputs:
                        generated[c.index] += len(c.token_ids)
                        delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
                        if tool_call is not None:
                            texts[c.index] += c.text
                            if c.finish_reason is None:
                                continue
                            calls, finish_reason = read_tool_calls(tool_call, texts[c.index], c.finish_reason)
                            delta = (
                                DeltaMessage(tool_calls=[{"index": i, **call} for i, call in enumerate(calls)])
                                if calls
                                else DeltaMessage(content=texts[c.index])
                            )
                        choice = ChatChunkChoice(
                            index=c.index,
                            delta=delta,
                            logprobs=chat_logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                            finish_reason=finish_reason,
                            stop_reason=c.stop_reason,
                        )
                        yield chunk([choice], usage(prompt_tokens, sum(generated)) if continuous else None)
            if include_usage:
                yield chunk([], usage(prompt_tokens, sum(generated)))
        except Exception as e:
            yield convert_engine_errors(e).sse()
        yield SSE_DONE


def read_tool_calls(
    tool_call: ForcedToolCall | None, text: str, finish_reason: str | None
) -> tuple[list[dict] | None, str | None]:
    """A forced call's text as OpenAI `tool_calls` (finish_reason "tool_calls"); cut-short text stays text."""
    calls = tool_call.tool_calls(text) if tool_call is not None and finish_reason == "stop" else None
    return calls, "tool_calls" if calls else finish_reason


def message_dict(message: ChatMessage) -> dict:
    """A message as chat templates expect it: text parts joined into one string."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    out = {"role": message.role, "content": content if content is not None else ""}
    for key in ("name", "tool_call_id", "tool_calls"):
        if (value := getattr(message, key)) is not None:
            out[key] = value
    return out


def chat_logprobs(c: CompletionOutput, k: int) -> ChatLogProbs:
    """OpenAI's chat logprobs: per sampled token, its logprob and the top `k` alternatives."""
    content = []
    for token, entries in zip(c.token_ids, c.logprobs or [], strict=True):
        chosen = entries[token]
        top = sorted((e for e in entries.values() if e.rank <= k), key=lambda e: e.rank)
        content.append(
            TokenLogprob(
                token=chosen.decoded_token or "",
                logprob=chosen.logprob,
                bytes=list((chosen.decoded_token or "").encode()),
                top_logprobs=[
                    TopLogprob(
                        token=e.decoded_token or "", logprob=e.logprob, bytes=list((e.decoded_token or "").encode())
                    )
                    for e in top
                ],
            )
        )
    return ChatLogProbs(content=content)

"""POST /v1/chat/completions: messages through the chat template → a reply, streamed or not.

Tool calls come back through a tool-call parser (tool_parsers/): the server's `--tool-call-parser`
under tool_choice "auto" (the default when tools are given), or the forced-call readers for a named
function or "required". A reasoning model's thinking is split off first (jaxllm/reasoning/): the tool-call
parser reads the answer after it. A choice's text goes through the same readers whether it is streamed or not.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

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
    UsageInfo,
    random_id,
)
from jaxllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    convert_engine_errors,
    engine_error,
    last_output,
    prompt_logprobs_json,
    sse,
    usage,
)
from jaxllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolCallParser,
    ParsedDelta,
    RequiredToolCallsParser,
    ToolCallDelta,
    ToolParser,
)
from jaxllm.outputs import CompletionOutput
from jaxllm.reasoning import ReasoningSplitter
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams
from jaxllm.structured.openai_fields import OutputConstraint, tool_names


@dataclass
class PreparedChat:
    """A checked chat request, ready to run: its rendered prompt, sampling parameters and how to read replies."""

    prompt: dict  # {"prompt": text, "prompt_token_ids": ids}
    params: SamplingParams
    tool_parser: Callable[[], ToolParser] | None  # a new parser per choice; None: the reply is plain content
    echo: str  # vLLM's chat echo: text the reply starts with
    reasoning: Callable[[], ReasoningSplitter] | None = None  # a new splitter per choice; None: no thinking
    include_reasoning: bool = True  # false: the thinking is split off and dropped

    def reader(self) -> ChoiceReader:
        return ChoiceReader(
            self.tool_parser() if self.tool_parser is not None else None,
            self.reasoning() if self.reasoning is not None else None,
            self.include_reasoning,
        )

    @property
    def reasons(self) -> bool:
        return self.reasoning is not None


class ChoiceReader:
    """One choice's text → reasoning, content and tool-call pieces, a step at a time (streams) or all at once."""

    def __init__(self, parser: ToolParser | None, splitter: ReasoningSplitter | None = None, include: bool = True):
        self.parser, self.splitter, self.include_reasoning = parser, splitter, include

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.reasoning_tokens if self.splitter is not None else 0

    def step(self, text: str, engine_reason: str | None, token_ids=()) -> tuple[ParsedDelta, str | None]:
        """What `text` (new since the last step; `token_ids` its tokens) adds, and the choice's finish reason once
        it ends."""
        reasoning = ""
        if self.splitter is not None:
            split = self.splitter.feed(text, token_ids)
            if engine_reason is not None:
                rest = self.splitter.finish()
                split.reasoning, split.content = split.reasoning + rest.reasoning, split.content + rest.content
            reasoning, text = split.reasoning if self.include_reasoning else "", split.content
        if self.parser is None:
            return ParsedDelta(content=text, reasoning=reasoning), engine_reason
        delta = self.parser.feed(text)
        delta.reasoning = reasoning
        if engine_reason is None:
            return delta, None
        return delta.merge(self.parser.finish()), self.parser.finish_reason(engine_reason)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, request_id: str | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or (stream=True) the server-sent events. Request errors raise before anything runs."""
        self.check_request(request)
        prepared = await self.prepare(request)
        request_id = request_id or random_id("chatcmpl")
        lora = self.lora_request(request.model)
        outputs = self.generate_all(
            request_id, [prepared.prompt], [prepared.params], request.priority, request.user, lora
        )
        if request.stream:
            return self.stream(request, request_id, prepared, outputs)
        return await self.full_response(request, request_id, prepared, outputs)

    async def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """Everything that can refuse the request, before anything is queued (the Responses API shares it)."""
        constraint = self.output_constraint(request)
        parser = self.tool_parser(request, constraint)
        prompt = await self.render(request)
        params = self.chat_sampling_params(request, len(prompt["prompt_token_ids"]), constraint.params)
        return PreparedChat(
            prompt, params, parser, self.echo_text(request), self.splitter(prompt["prompt"]), request.include_reasoning
        )

    def splitter(self, prompt: str) -> Callable[[], ReasoningSplitter] | None:
        """A reasoning model's splitter, starting where the rendered prompt leaves the output: inside an open
        `<think>`, after a closed one (thinking off), or where the model may open one."""
        syntax = self.options.reasoning
        if syntax is None:
            return None
        return functools.partial(ReasoningSplitter, syntax, syntax.first_phase(prompt), self.options.reasoning_end_id)

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

    def tool_parser(
        self, request: ChatCompletionRequest, constraint: OutputConstraint
    ) -> Callable[[], ToolParser] | None:
        """How replies are read back: a forced call, the server's parser under "auto", or plain content."""
        max_calls = None if request.parallel_tool_calls else 1
        forced = constraint.tool_call
        if forced is not None:
            if forced.named is not None:
                return functools.partial(NamedToolCallParser, forced.named)
            return functools.partial(RequiredToolCallsParser, tool_names(request), max_calls)
        if not request.tools or request.tool_choice not in (None, "auto"):
            return None
        if self.options.tool_parser is None:
            raise bad_request(
                'tool_choice "auto" (the default when tools are given) needs a tool-call parser for this model: '
                "start the server with --enable-auto-tool-choice --tool-call-parser NAME "
                f"(one of: {', '.join(TOOL_PARSERS)}), or use tool_choice 'required' or name a function",
                param="tool_choice",
            )
        return functools.partial(TOOL_PARSERS[self.options.tool_parser], max_calls)

    def chat_template(self, request: ChatCompletionRequest, messages: list[dict], tools: list | None) -> str | None:
        """The request's template, else --chat-template, else the tools template for a conversation with tools
        (when the server has one), else None: the model's own."""
        if request.chat_template is not None:
            return request.chat_template
        if self.options.chat_template is not None:
            return self.options.chat_template
        with_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        return self.options.tools_chat_template if with_tools else None

    async def render(self, request: ChatCompletionRequest) -> dict:
        """The conversation through the chat template: {"prompt": text, "prompt_token_ids": ids}.

        A conversation too long to fit is refused before it is rendered; a long one is rendered
        and tokenized off the event loop.
        """
        if not request.messages:
            raise bad_request("messages must be a non-empty list", param="messages")
        if request.continue_final_message and request.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
            )
        messages = [message_dict(m) for m in request.messages]
        tools = request.tools if request.tool_choice != "none" else None
        template = self.chat_template(request, messages, tools)
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template and template is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        chars = sum(len(m["content"]) for m in messages)
        if request.truncate_prompt_tokens is None:
            self.tokenizing.check_length(chars, "messages")
        text, ids = await self.tokenizing.run(chars, self._render, request, messages, tools, template)
        ids = self.truncate(ids, request)
        self.check_prompt(ids, "messages")
        return {"prompt": text, "prompt_token_ids": ids}

    def _render(
        self, request: ChatCompletionRequest, messages: list[dict], tools: list | None, template: str | None
    ) -> tuple[str, list[int]]:
        tokenizer = self.engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=template,
                tools=tools,
                documents=request.documents,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as e:  # a template that rejects the conversation (roles out of order, ...)
            raise bad_request(f"the chat template failed on these messages: {e}", param="messages") from None
        return text, tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    @staticmethod
    def echo_text(request: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the reply starts with the last message's text when it is the assistant's."""
        last = request.messages[-1]
        if request.echo and last.role == "assistant":
            return message_dict(last)["content"]
        return ""

    async def full_response(self, request, request_id, prepared: PreparedChat, outputs) -> ChatCompletionResponse:
        final = await last_output(outputs)
        choices = []
        reasoning_tokens = 0
        for c in final.outputs:
            reader = prepared.reader()
            parsed, finish_reason = reader.step(c.text, c.finish_reason, c.token_ids)
            reasoning_tokens += reader.reasoning_tokens
            calls = [call.openai() for call in parsed.calls] or None
            content: str | None = prepared.echo + parsed.content
            if calls and not content:
                content = None
            thinking = parsed.reasoning or None
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(
                        content=content, reasoning_content=thinking, reasoning=thinking, tool_calls=calls
                    ),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=self.logprobs(request, c),
                )
            )
        generated = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name(request),
            choices=choices,
            usage=usage(
                len(prepared.prompt["prompt_token_ids"]), generated, self.reasoning_count(prepared, reasoning_tokens)
            ),
            prompt_logprobs=prompt_logprobs_json(final),
            kv_transfer_params=final.kv_transfer_params,
        )

    async def stream(self, request, request_id, prepared: PreparedChat, outputs) -> AsyncIterator[str]:
        model = self.model_name(request)
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        continuous = include_usage and request.stream_options.continuous_usage_stats
        prompt_tokens = len(prepared.prompt["prompt_token_ids"])
        generated = [0] * request.n
        readers = [prepared.reader() for _ in range(request.n)]
        head = ChatCompletionChunk(id=request_id, created=int(time.time()), model=model, choices=[])

        def chunk(choices, usage_info=None) -> str:
            return sse(head.model_copy(update={"choices": choices, "usage": usage_info}))

        def usage_now() -> UsageInfo:
            reasoning = self.reasoning_count(prepared, sum(r.reasoning_tokens for r in readers))
            return usage(prompt_tokens, sum(generated), reasoning)

        try:
            # every choice opens with the role, as OpenAI's stream does
            yield chunk(
                [
                    ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=prepared.echo))
                    for i in range(request.n)
                ]
            )
            async with aclosing(outputs):
                async for _, out in outputs:
                    if (error := engine_error(out)) is not None:
                        yield error.sse()
                        break
                    for c in out.outputs:
                        generated[c.index] += len(c.token_ids)
                        reader = readers[c.index]
                        parsed, finish_reason = reader.step(c.text, c.finish_reason, c.token_ids)
                        deltas = delta_messages(parsed, plain=reader.parser is None)
                        if not deltas and (finish_reason or request.logprobs):
                            deltas = [DeltaMessage()]
                        for i, delta in enumerate(deltas):  # nothing when the parser holds text back
                            last = i == len(deltas) - 1
                            choice = ChatChunkChoice(
                                index=c.index,
                                delta=delta,
                                logprobs=self.logprobs(request, c) if last else None,
                                finish_reason=finish_reason if last else None,
                                stop_reason=c.stop_reason if last else None,
                            )
                            yield chunk([choice], usage_now() if continuous else None)
            if include_usage:
                yield chunk([], usage_now())
        except Exception as e:
            yield convert_engine_errors(e).sse()
        yield SSE_DONE

    @staticmethod
    def reasoning_count(prepared: PreparedChat, tokens: int) -> int | None:
        """usage's reasoning_tokens: counted where the model reasons, absent where it cannot."""
        return tokens if prepared.reasons else None

    @staticmethod
    def logprobs(request: ChatCompletionRequest, c: CompletionOutput) -> ChatLogProbs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(c, request.top_logprobs or 0, request.return_tokens_as_token_ids)


def delta_messages(parsed: ParsedDelta, plain: bool) -> list[DeltaMessage]:
    """A step's stream deltas, as OpenAI sends them: reasoning, content, then for each call its id and name first
    (arguments "") and its argument fragments after. `plain`: no parser, a content delta even if empty (unless
    the step was all reasoning)."""
    deltas = [DeltaMessage(reasoning_content=parsed.reasoning, reasoning=parsed.reasoning)] if parsed.reasoning else []
    if plain:
        return deltas + [DeltaMessage(content=parsed.content)] if parsed.content or not deltas else deltas
    deltas += [DeltaMessage(content=parsed.content)] if parsed.content else []
    for piece in parsed.calls:
        if piece.id is not None and piece.arguments:
            head = ToolCallDelta(piece.index, piece.id, piece.name)
            deltas.append(DeltaMessage(tool_calls=[head.openai()]))
            piece = ToolCallDelta(piece.index, arguments=piece.arguments)
        deltas.append(DeltaMessage(tool_calls=[piece.openai()]))
    return deltas


def message_dict(message: ChatMessage) -> dict:
    """A message as chat templates expect it: text parts joined into one string."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    out = {"role": message.role, "content": content if content is not None else ""}
    for key in ("name", "tool_call_id", "tool_calls"):
        if (value := getattr(message, key)) is not None:
            out[key] = value
    thinking = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if thinking is not None:  # the name reasoning models' templates read
        out["reasoning_content"] = thinking
    return out


def chat_logprobs(c: CompletionOutput, k: int, as_token_ids: bool = False) -> ChatLogProbs:
    """OpenAI's chat logprobs: per sampled token, its logprob and the top `k` alternatives.

    `as_token_ids` (vLLM's return_tokens_as_token_ids) names each token "token_id:N" instead of its text.
    """

    def name(token: int, decoded: str | None) -> str:
        return f"token_id:{token}" if as_token_ids else decoded or ""

    content = []
    for token, entries in zip(c.token_ids, c.logprobs or [], strict=True):
        chosen = entries[token]
        top = sorted(((t, e) for t, e in entries.items() if e.rank <= k), key=lambda te: te[1].rank)
        text = name(token, chosen.decoded_token)
        content.append(
            TokenLogprob(
                token=text,
                logprob=chosen.logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=name(t, e.decoded_token), logprob=e.logprob, bytes=list(name(t, e.decoded_token).encode())
                    )
                    for t, e in top
                ],
            )
        )
    return ChatLogProbs(content=content)

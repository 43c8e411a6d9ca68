"""POST /v1/responses: the Responses API, as vLLM serves it, on the chat endpoint's machinery.

The request becomes a chat request (responses_protocol.py); the reply is read by the same
per-choice reader (plain text, or tool calls through the server's parser) and laid out as
Responses output items: a `reasoning` item with a model's thinking (one `reasoning_text` part), a `message` with
one `output_text` part, and a `function_call` per call.
Streamed, the events are OpenAI's: response.created, response.in_progress, then per item
response.output_item.added, its content or argument deltas and their done events,
response.output_item.done, and last response.completed (or response.incomplete when
max_output_tokens cut it short), each an SSE `event:` line and its JSON with a sequence_number.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from jaxllm.entrypoints.openai.errors import OpenAIError
from jaxllm.entrypoints.openai.responses_protocol import ResponsesRequest, chat_request
from jaxllm.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat
from jaxllm.entrypoints.openai.serving_engine import convert_engine_errors, engine_error, last_output
from jaxllm.entrypoints.openai.tool_parsers import ParsedDelta, ToolParser

# chat's names for the fields a Responses request has under other names
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items, built a step at a time from the parsed reply; each step returns the
    stream events it makes (payloads are copies: later steps change the items)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being generated
        self._calls: dict[int, dict] = {}  # the parser's call index → its item

    def step(self, parsed: ParsedDelta) -> list[dict]:
        events: list[dict] = []
        if parsed.reasoning:
            events += self._text(parsed.reasoning, "reasoning")
        if parsed.content:
            events += self._text(parsed.content, "message")
        for piece in parsed.calls:
            if piece.id is not None:
                events += self._close("completed")
                item: dict[str, Any] = {
                    "type": "function_call",
                    "id": item_id("fc"),
                    "call_id": piece.id,
                    "name": piece.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                events += self._add(item)
                self._calls[piece.index] = item
            item = self._calls[piece.index]
            if piece.arguments:
                item["arguments"] += piece.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": item["id"],
                        "output_index": self.items.index(item),
                        "delta": piece.arguments,
                    }
                )
        return events

    def _text(self, text: str, kind: str) -> list[dict]:
        """`text` added to the open item of `kind` (a reasoning item or a message), opened if need be."""
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed") + self._open_text_item(kind)
        assert self._open is not None
        self._open["content"][0]["text"] += text
        event = {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0, "delta": text}
        if kind == "message":
            return events + [{"type": "response.output_text.delta", **event, "logprobs": []}]
        return events + [{"type": "response.reasoning_text.delta", **event}]

    def finish(self, status: str) -> list[dict]:
        """The reply ended: the last item closes ("incomplete" when cut short); no output is an empty message."""
        events = [] if self.items else self._open_text_item("message")
        return events + self._close(status)

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)}]

    def _open_text_item(self, kind: str) -> list[dict]:
        part: dict[str, Any]
        item: dict[str, Any]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"type": "message", "id": item_id("msg"), "status": "in_progress", "role": "assistant"}
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": item_id("rs"), "status": "in_progress", "summary": []}
        item["content"] = []
        events = self._add(item)
        item["content"] = [part]
        events.append(
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": len(self.items) - 1,
                "content_index": 0,
                "part": copy.deepcopy(part),
            }
        )
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = self.items.index(item)
        events: list[dict] = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                events.append({"type": "response.output_text.done", **common, "text": part["text"], "logprobs": []})
            else:
                events.append({"type": "response.reasoning_text.done", **common, "text": part["text"]})
            events.append({"type": "response.content_part.done", **common, "part": copy.deepcopy(part)})
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        events.append({"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)})
        return events


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat  # renders, constrains and reads replies exactly as the chat endpoint does

    async def create_response(
        self, request: ResponsesRequest, request_id: str | None = None
    ) -> dict | AsyncIterator[str]:
        """The response object, or (stream=True) its server-sent events. Request errors raise before anything runs."""
        try:
            chat = chat_request(request)
            self.chat.check_request(chat)
            prepared = limit_calls(await self.chat.prepare(chat), request.max_tool_calls)
        except OpenAIError as e:
            raise renamed(e) from None
        response_id = item_id("resp")
        head = self.head(request, response_id)
        outputs = self.chat.generate_all(
            request_id or response_id,
            [prepared.prompt],
            [prepared.params],
            chat.priority,
            chat.user,
            self.chat.lora_request(chat.model),
        )
        if request.stream:
            return self.stream(head, prepared, outputs)
        return await self.full_response(head, prepared, outputs)

    def head(self, request: ResponsesRequest, response_id: str) -> dict:
        """The response object without its output: what response.created carries."""
        text_format = (request.text or {}).get("format") or {"type": "text"}
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": request.model or self.chat.served_model_names[0],
            "output": [],
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "tools": request.tools or [],
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls,
            "max_tool_calls": request.max_tool_calls,
            "text": {"format": text_format},
            "metadata": request.metadata or {},
            "user": request.user,
            "store": False,
            "background": False,
            "truncation": "disabled",
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "default",
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }

    @staticmethod
    def done(head: dict, items: OutputItems, finish_reason: str | None, usage: tuple[int, int, int, int]) -> dict:
        """The finished response object; `usage` is (input, cached input, output, reasoning) tokens."""
        incomplete = finish_reason == "length"
        input_tokens, cached_tokens, output_tokens, reasoning_tokens = usage
        return {
            **head,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": items.items,
            "usage": {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": input_tokens + output_tokens,
            },
        }

    async def full_response(self, head: dict, prepared: PreparedChat, outputs) -> dict:
        final = await last_output(outputs)
        (c,) = final.outputs
        reader = prepared.reader()
        parsed, finish_reason = reader.step(c.text, c.finish_reason, c.token_ids)
        items = OutputItems()
        items.step(parsed)
        items.finish("incomplete" if finish_reason == "length" else "completed")
        prompt_tokens = len(prepared.prompt["prompt_token_ids"])
        usage = (prompt_tokens, final.num_cached_tokens, len(c.token_ids), reader.reasoning_tokens)
        return self.done(head, items, finish_reason, usage)

    async def stream(self, head: dict, prepared: PreparedChat, outputs) -> AsyncIterator[str]:
        sequence = 0

        def event(payload: dict) -> str:
            nonlocal sequence
            payload = {**payload, "sequence_number": sequence}
            sequence += 1
            return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        reader, items = prepared.reader(), OutputItems()
        yield event({"type": "response.created", "response": head})
        yield event({"type": "response.in_progress", "response": head})
        try:
            finish_reason, cached, generated = None, 0, 0
            async with aclosing(outputs):
                async for _, out in outputs:
                    if (error := engine_error(out)) is not None:
                        yield event(error_event(error))
                        return
                    cached = out.num_cached_tokens
                    for c in out.outputs:
                        generated += len(c.token_ids)
                        parsed, finish_reason = reader.step(c.text, c.finish_reason, c.token_ids)
                        for payload in items.step(parsed):
                            yield event(payload)
            for payload in items.finish("incomplete" if finish_reason == "length" else "completed"):
                yield event(payload)
            usage = (len(prepared.prompt["prompt_token_ids"]), cached, generated, reader.reasoning_tokens)
            response = self.done(head, items, finish_reason, usage)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield event({"type": kind, "response": response})
        except Exception as e:
            yield event(error_event(convert_engine_errors(e)))


def limit_calls(prepared: PreparedChat, max_tool_calls: int | None) -> PreparedChat:
    """`max_tool_calls`: calls past the limit are dropped by the reply's parser."""
    make = prepared.tool_parser
    if max_tool_calls is None or make is None:
        return prepared

    def limited() -> ToolParser:
        parser = make()
        parser.max_calls = min(parser.max_calls or max_tool_calls, max_tool_calls)
        return parser

    return dataclasses.replace(prepared, tool_parser=limited)


def error_event(error: OpenAIError) -> dict:
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}


def renamed(error: OpenAIError) -> OpenAIError:
    """An error about the chat request, naming the Responses field it came from."""
    param = error.param
    if param is not None:
        head, dot, rest = param.partition(".")
        if head in PARAMS:
            param = PARAMS[head] + dot + rest
            if head == "response_format" and rest.startswith("json_schema."):
                param = "text.format." + rest.removeprefix("json_schema.")
    return OpenAIError(error.message, status=error.status, param=param, code=error.code)

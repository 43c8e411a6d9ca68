"""What every tool-call parser shares: generated text in, content and OpenAI tool calls out, a piece at a time.

A parser is fed the text of one choice as it is generated (`feed`) and told when it ends
(`finish`); each call returns the new content and the new tool-call pieces (`ParsedDelta`). A
streamed response sends those pieces as OpenAI's deltas (a call's id and name first, then its
arguments in fragments); a whole response feeds everything at once and reads `content` and
`calls`, so both say exactly the same thing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as far as it was generated

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A new piece of call `index`: its first piece carries `id` and `name`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        """OpenAI's streamed `tool_calls` entry."""
        function: dict = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        entry: dict = {"index": self.index}
        if self.id is not None:
            entry.update(id=self.id, type="function")
        return {**entry, "function": function}


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""  # a reasoning model's thinking (jaxllm/reasoning/), before the content

    def merge(self, other: ParsedDelta) -> ParsedDelta:
        calls = list(self.calls)
        for piece in other.calls:
            if calls and calls[-1].index == piece.index:
                last = calls[-1]
                calls[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + piece.arguments)
            else:
                calls.append(piece)
        return ParsedDelta(self.content + other.content, calls, self.reasoning + other.reasoning)


class ToolParser:
    """Base class: keeps the content and calls found so far; subclasses decide what the text means."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls  # 1 when parallel_tool_calls is false: later calls are dropped
        self.content = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedDelta:
        """All of a finished output at once."""
        return self.feed(text).merge(self.finish())

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called a tool and stopped on its own; "length" stays."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    # ---- for subclasses ----------------------------------------------------------------------------

    def _content(self, text: str, out: ParsedDelta) -> None:
        if text:
            self.content += text
            out.content += text

    def _open_call(self, name: str, out: ParsedDelta) -> int | None:
        """Start a call; its index, or None when max_calls drops it."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return None
        call = ToolCall(tool_call_id(), name)
        self.calls.append(call)
        index = len(self.calls) - 1
        out.calls.append(ToolCallDelta(index, call.id, name))
        return index

    def _arguments(self, index: int | None, piece: str, out: ParsedDelta) -> None:
        if index is None or not piece:
            return
        self.calls[index].arguments += piece
        if out.calls and out.calls[-1].index == index:
            last = out.calls[-1]
            last.arguments += piece
        else:
            out.calls.append(ToolCallDelta(index, arguments=piece))

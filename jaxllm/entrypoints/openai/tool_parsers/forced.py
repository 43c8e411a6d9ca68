"""Reading back a forced tool call (`tool_choice` naming a function, or "required"), whole or streamed.

The output is constrained (structured/openai_fields.py): for a named function it is the
arguments object itself; for "required" a JSON array of `{"name": ..., "parameters": {...}}`.
Either way the call is streamed as it is generated, and one cut short by `max_tokens` comes back
as a partial call (finish_reason "length"), as OpenAI returns it, never as raw JSON in `content`.
"""

from __future__ import annotations

import json
import re

from jaxllm.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolParser
from jaxllm.entrypoints.openai.tool_parsers.json_stream import CallReader

PARTIAL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)$')


class NamedToolCallParser(ToolParser):
    """The output is the arguments of `name`."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._index: int | None = None

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self.calls:
            self._index = self._open_call(self.name, out)
        self._arguments(self._index, text, out)
        return out

    def finish(self) -> ParsedDelta:
        return self.feed("") if not self.calls else ParsedDelta()


class RequiredToolCallsParser(ToolParser):
    """The output is a JSON array of calls of the given functions."""

    def __init__(self, names: list[str], max_calls: int | None = None):
        super().__init__(max_calls)
        self.names = names
        self._text = ""
        self._pos = 0  # where the next call may start
        self._start = 0  # where the open call starts
        self._reader: CallReader | None = None
        self._index: int | None = None

    def feed(self, text: str) -> ParsedDelta:
        self._text += text
        out = ParsedDelta()
        while True:
            if self._reader is None:
                pos = self._pos
                while pos < len(self._text) and self._text[pos] in " \t\r\n[,":
                    pos += 1
                if pos >= len(self._text) or self._text[pos] != "{":
                    self._pos = pos
                    return out
                self._start, self._reader, self._index = pos, CallReader(), None
            reader = self._reader
            opened = reader.name is not None
            piece = reader.update(self._text[self._start :])
            if reader.name is not None and not opened:
                self._index = self._open_call(reader.name, out)
            self._arguments(self._index, piece, out)
            if reader.end is None:
                return out
            self._pos, self._reader = self._start + reader.end, None

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        reader = self._reader
        if reader is not None and reader.name is None:
            piece = reader.update(self._text[self._start :], final=True)  # cut right after the name
            if reader.name is not None:
                self._arguments(self._open_call(reader.name, out), piece, out)
            else:  # cut inside the name: complete it when only one function fits
                match = PARTIAL_NAME.match(self._text, self._start)
                try:
                    prefix = json.loads(f'"{match[1]}"') if match is not None else None
                except json.JSONDecodeError:
                    prefix = None
                fits = [n for n in self.names if prefix is not None and n.startswith(prefix)]
                if len(fits) == 1:
                    self._open_call(fits[0], out)
        self._reader = None
        return out

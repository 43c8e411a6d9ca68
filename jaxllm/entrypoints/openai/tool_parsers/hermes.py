"""`hermes`: calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (vLLM's parser name).

The format of Hermes 2 Pro, Qwen2.5 and the shipped `chatml_tools` template. Text outside the tags
is content (whitespace next to a call is not); a call's id and name go out as soon as its name is
complete, then its arguments as they are generated. A block that is not a call (no name, not JSON)
is given back as content, and a call cut short by the end of the output is returned as far as it got.
"""

from __future__ import annotations

from jaxllm.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolParser
from jaxllm.entrypoints.openai.tool_parsers.json_stream import CallReader, parse_call

START, END = "<tool_call>", "</tool_call>"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser(ToolParser):
    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._buffer = ""  # text not yet given out: held-back content, or the open call's body
        self._reader: CallReader | None = None  # the call being read, between its tags
        self._index: int | None = None  # that call's index in `calls` (None: not opened, or dropped)
        self._opened = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            if self._reader is None:
                start = self._buffer.find(START)
                if start < 0:
                    # hold back what may begin a tag, and trailing whitespace (dropped if a call follows)
                    ready = self._buffer[: len(self._buffer) - partial_suffix(self._buffer, START)].rstrip()
                    self._content(ready, out)
                    self._buffer = self._buffer[len(ready) :]
                    return out
                self._content(self._buffer[:start].rstrip(), out)
                self._buffer = self._buffer[start + len(START) :]
                self._reader, self._index, self._opened = CallReader(), None, False
            end = self._buffer.find(END)
            if end < 0:
                self._read(self._buffer[: len(self._buffer) - partial_suffix(self._buffer, END)], out)
                return out
            called = self._close(self._buffer[:end], out, closed=True)
            rest = self._buffer[end + len(END) :]
            self._buffer = rest.lstrip() if called else rest
            self._reader = None

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._reader is None:
            if not (self.calls and not self._buffer.strip()):
                self._content(self._buffer, out)
        else:  # the output ended inside a call: a call cut short, or one that never wrote its closing tag
            self._close(self._buffer, out, closed=False)
        self._buffer, self._reader = "", None
        return out

    def _read(self, body: str, out: ParsedDelta, final: bool = False) -> None:
        reader = self._reader
        assert reader is not None
        piece = reader.update(body, final)
        if reader.name is not None and not self._opened:
            self._opened = True
            self._index = self._open_call(reader.name, out)
        self._arguments(self._index, piece, out)

    def _close(self, body: str, out: ParsedDelta, closed: bool) -> bool:
        """The call's last piece (its closing tag, or the output's end); False when it was not a call."""
        reader = self._reader
        assert reader is not None
        self._read(body, out, final=True)
        if reader.name is not None:
            self._arguments(self._index, reader.finish(body), out)
            return True
        call = parse_call(body)  # keys in another order: read whole
        if call is None:  # not a call after all: the text stays text
            self._content(START + body + (END if closed else ""), out)
            return False
        index = self._open_call(call[0], out)
        self._arguments(index, call[1], out)
        return True

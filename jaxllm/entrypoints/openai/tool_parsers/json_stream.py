"""Reading a tool call's JSON while it is generated: where a JSON value ends, and a call object's parts.

A call is `{"name": "...", "arguments": {...}}` (or `"parameters"`, as the forced `required` output
writes it). Its arguments are streamed as they come, so their end must be found without parsing:
`ValueEnd` follows strings, escapes and nesting a piece at a time, and `CallReader` says what is
known of one call object so far (its name, how much of its arguments, whether they are closed).
"""

from __future__ import annotations

import json
import re

# the head of a call object, up to the first character of its arguments' value
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ValueEnd:
    """Finds where a JSON object or array ends, fed a piece at a time (it must start with `{` or `[`)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.closed = False

    def feed(self, text: str) -> int | None:
        """How many characters of `text` complete the value, or None when it is still open after all of them."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.closed = True
                    return i + 1
        return None


class CallReader:
    """One call object, read from a growing text (`update` is given the whole text so far, each time longer).

    `arguments` grows with the text while the arguments are an object or array; other values
    (a JSON string of arguments, as some models write them) are only read once the call ends.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments = ""  # the arguments' JSON text read so far
        self.arguments_closed = False
        self.end: int | None = None  # where the call object ends in the text, once its `}` is seen
        self._start: int | None = None  # where the arguments' value starts in the text
        self._read = 0  # how far into the text the arguments were read
        self._value: ValueEnd | None = None

    def update(self, text: str, final: bool = False) -> str:
        """Read what is new in `text`; returns the new piece of arguments (may be "").

        The name counts once the arguments' first character is there (more whitespace may come
        before it), or at the `final` text of a call cut short.
        """
        if self.name is None:
            match = CALL_HEAD.match(text)
            if match is None or (match.end() == len(text) and not final):
                return ""
            try:
                self.name = json.loads(f'"{match[1]}"')
            except json.JSONDecodeError:
                return ""
            self._start = self._read = match.end()
        start = self._start
        assert start is not None
        if self._value is None:
            if len(text) <= start or text[start] not in "{[":
                return ""  # not begun yet, or a value read whole at the end
            self._value = ValueEnd()
        piece = ""
        if not self.arguments_closed:
            new = text[self._read :]
            used = self._value.feed(new)
            piece = new if used is None else new[:used]
            self._read += len(piece)
            self.arguments += piece
            self.arguments_closed = used is not None
        if self.arguments_closed and self.end is None:
            tail = re.match(r"\s*\}", text[self._read :])
            if tail is not None:
                self.end = self._read + tail.end()
        return piece

    def finish(self, text: str) -> str:
        """The call ended at the end of `text` (its closing tag, or the output's end): the rest of its arguments.

        Arguments that were not streamed (not an object) are read from the parsed call now; an
        object cut short stays as far as it got (a partial call, as OpenAI returns one cut by length).
        """
        if self.name is None or self._value is not None:
            return ""
        try:
            call = json.loads(text)
            value = call.get("arguments", call.get("parameters"))
        except (json.JSONDecodeError, AttributeError):
            start = self._start or 0
            value = text[start:].rstrip().removesuffix("}").rstrip()
            self.arguments = value
            return value
        self.arguments = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        self.arguments_closed = True
        return self.arguments


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object in any key order, or None."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)

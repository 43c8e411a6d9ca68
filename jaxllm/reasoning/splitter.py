"""One output's text split into reasoning and answer as it streams, by text, not by token: a chunk may carry
several tokens that straddle `</think>` (speculative decoding's accepted drafts), and a tag may arrive split over
chunks. Streamed and whole outputs go through the same splitter, so their splits are equal.

Whitespace the templates put around the tags is dropped: the reasoning is stripped at both ends and the answer
at its start (held back while it could still be followed by more text)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.reasoning.syntax import Phase, ReasoningSyntax


@dataclass
class SplitDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    def __init__(self, syntax: ReasoningSyntax, phase: Phase, end_token_id: int | None = None):
        self.syntax, self.phase = syntax, phase
        self.end_token_id = end_token_id  # counts the reasoning's tokens (None: not counted)
        self.reasoning_tokens = 0
        self._counting = phase is not Phase.ANSWER
        self._buf = ""
        self._fresh = True  # at the start of the current phase: leading whitespace (and a repeated tag) dropped

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> SplitDelta:
        """What `text` (new since the last call; `token_ids` its tokens) adds to the reasoning and the answer."""
        self._buf += text
        out = SplitDelta()
        while self._advance(out):
            pass
        self._count(token_ids)
        return out

    def finish(self) -> SplitDelta:
        """The text held back at the output's end (a partial tag is text after all)."""
        out, rest, self._buf = SplitDelta(), self._buf, ""
        if self.phase is Phase.REASONING:
            out.reasoning = rest.strip() if self._fresh else rest.rstrip()
        else:
            out.content = rest.lstrip() if self._fresh else rest
        return out

    def _advance(self, out: SplitDelta) -> bool:
        """Consume what can be decided from the buffer; True when the phase changed (go again)."""
        start, end = self.syntax.start, self.syntax.end
        if self.phase is Phase.MAY_OPEN:
            head = self._buf.lstrip()
            if head.startswith(start):
                self._buf, self.phase = head[len(start) :], Phase.REASONING
                return True
            if start.startswith(head):  # nothing yet, or a partial tag: wait
                return False
            self.phase = Phase.ANSWER
            return True
        if self.phase is Phase.REASONING:
            if self._fresh:
                head = self._buf.lstrip()
                if head.startswith(start):  # a model that writes the tag the template opened already
                    self._buf = head[len(start) :]
                    return True
                self._buf = head
                if not head or start.startswith(head):
                    return False
                self._fresh = False
            i = self._buf.find(end)
            if i >= 0:
                out.reasoning += self._buf[:i].rstrip()
                self._buf, self.phase, self._fresh = self._buf[i + len(end) :], Phase.ANSWER, True
                return True
            ready = self._buf[: len(self._buf) - _partial_suffix(self._buf, end)].rstrip()
            out.reasoning += ready
            self._buf = self._buf[len(ready) :]
            return False
        if self._fresh:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._fresh = False
        out.content += self._buf
        self._buf = ""
        return False

    def _count(self, token_ids) -> None:
        if not self._counting or self.end_token_id is None:
            return
        ids = list(token_ids)
        if self.end_token_id in ids:
            self.reasoning_tokens += ids.index(self.end_token_id) + 1
            self._counting = False
        elif self.phase is Phase.ANSWER:  # a qwen3 output that did not open <think>
            self._counting = False
        else:
            self.reasoning_tokens += len(ids)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag that may be completed by the next chunk)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

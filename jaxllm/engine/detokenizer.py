"""Incremental detokenization with stop strings (host side, pure Python, no JAX).

One `IncrementalDetokenizer` per request (per sample when n > 1). Each step the engine
feeds the new token ids with `update`; it returns the stop string when one now appears
in the text (the text is cut before it, or after it with include_stop_str_in_output).
`output_text` is the text so far; `get_delta()` what streaming should send next.

Decoding follows vLLM's prefix_offset / read_offset scheme: a sliding window of ids is
decoded, and text is released only once the window's text grows and does not end in
U+FFFD, so a UTF-8 character split over several byte tokens is never emitted half-way.
The window starts on the last few prompt tokens, so the first output token's leading
space comes out as it would in the middle of the text (SentencePiece tokenizers drop it
at the very start of a decode). Each step decodes only the window, never the whole
output: O(1) amortised per token.

The released text equals `tokenizer.decode(output_ids, skip_special_tokens=...)` for
byte-level BPE tokenizers; for SentencePiece ones it keeps the first token's leading space
(vLLM's behaviour). Tokenizers with `clean_up_tokenization_spaces` are not cleaned up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

INITIAL_CONTEXT_TOKENS = 5  # prompt tokens that prime the window (vLLM's value)
MAX_WINDOW_TOKENS = 32  # past this, release the window even if it ends in U+FFFD (invalid bytes)
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] | str = (),
        include_stop_str_in_output: bool = False,
    ):
        stops = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be non-empty strings, got {stops!r}")
        self.stop = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode_ids = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode_ids = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        self.token_ids: list[int] = []  # every output id fed so far
        self.stop_reason: str | None = None  # the stop string that ended the text, if any
        self.finished = False
        # the decoding window: ids[prefix:read] is decoded text already released, ids[read:] pending
        context = [int(t) for t in list(prompt_token_ids)[-INITIAL_CONTEXT_TOKENS:]]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT):  # prompt ends mid-character: start clean
            context, context_text = [], ""
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = context_text
        # the text: chunks joined lazily; the unsent part for get_delta; the tail for stop matching
        self._chunks: list[str] = []
        self._unsent: list[str] = []
        self._unsent_len = 0
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._tail = ""

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids)

    # ------------------------------------------------------------------ public

    @property
    def output_text(self) -> str:
        """The text so far (released text only: a trailing incomplete character waits for its bytes)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def update(self, new_token_ids: Iterable[int]) -> str | None:
        """Append tokens; returns the stop string that now ends the text, else None.

        After a stop (or `finish`), further tokens are ignored.
        """
        for token_id in new_token_ids:
            if self.finished:
                break
            self.token_ids.append(int(token_id))
            self._ids.append(int(token_id))
            delta = self._advance(final=False)
            if delta and self._append(delta):
                return self.stop_reason
        return None

    def finish(self) -> str | None:
        """The request ends for another reason: flush pending bytes (as U+FFFD if incomplete, like
        `tokenizer.decode`) and release the held-back characters. Returns a stop string if the
        flushed text completed one."""
        if self.finished:
            return None
        delta = self._advance(final=True)
        found = self._append(delta) if delta else False
        self.finished = True
        return self.stop_reason if found else None

    def get_delta(self) -> str:
        """Text added since the previous call. While unfinished, the last len(longest stop) - 1
        characters are held back, so a stop string being matched is never streamed."""
        if not self._unsent_len:
            return ""
        text = "".join(self._unsent)
        cut = len(text) if self.finished else max(0, len(text) - self._hold)
        rest = text[cut:]
        self._unsent = [rest] if rest else []
        self._unsent_len = len(rest)
        return text[:cut]

    # ------------------------------------------------------------------ internals

    def _advance(self, final: bool) -> str:
        """Decode the window; release its new text if it is complete (or `final`, or the window is too long)."""
        if self._read == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix :])
        window = len(self._ids) - self._prefix
        complete = len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT)
        if not (complete or final or window > MAX_WINDOW_TOKENS):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        if self._prefix > 4 * MAX_WINDOW_TOKENS:  # drop ids the window no longer needs
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta

    def _append(self, delta: str) -> bool:
        """Add released text; True if a stop string now appears (the text is then cut and finished)."""
        if not self.stop:
            self._push(delta)
            return False
        window = self._tail + delta
        found = None
        for s in self.stop:  # a new match must end inside delta: earlier text was already searched
            i = window.find(s, max(0, len(self._tail) - len(s) + 1))
            if i != -1 and (found is None or i < found[0]):
                found = (i, s)
        if found is None:
            self._push(delta)
            self._tail = window[-self._hold :] if self._hold else ""
            return False
        i, s = found
        cut = i + (len(s) if self.include_stop_str_in_output else 0)  # in window coordinates
        if cut >= len(self._tail):
            self._push(delta[: cut - len(self._tail)])
        else:
            self._drop(len(self._tail) - cut)  # only held-back characters: never streamed
        self.stop_reason = s
        self.finished = True
        return True

    def _push(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self._unsent.append(text)
            self._unsent_len += len(text)

    def _drop(self, n: int) -> None:
        """Remove the last n characters of the text (all of them unsent)."""
        assert n <= self._unsent_len
        unsent = "".join(self._unsent)[: self._unsent_len - n]
        self._unsent = [unsent] if unsent else []
        self._unsent_len = len(unsent)
        text = self.output_text[:-n]
        self._chunks = [text] if text else []

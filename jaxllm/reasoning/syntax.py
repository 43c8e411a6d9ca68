"""How a reasoning model marks its thinking, and where a request starts: inside the thinking or not.

Two syntaxes, vLLM's parser names. Both think between `<think>` and `</think>`; they differ in what an output
with no opening tag means:
- `qwen3` (Qwen3's hybrid models): the model opens `<think>` itself; an output that does not is all answer
  (thinking off, or a model that chose not to think).
- `deepseek_r1` (DeepSeek-R1 and its distills, Qwen3's thinking-only 2507 models, QwQ): the chat template opens
  `<think>` in the prompt, so everything before `</think>` is reasoning.

Where a request starts comes from its prompt's last tag, not from a flag: a prompt ending inside an open
`<think>` starts in the reasoning (the templates above); one whose last tag is `</think>` starts in the answer
(`enable_thinking: false` renders an empty `<think></think>`; vLLM #19839 put such answers in the reasoning).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("jaxllm.reasoning")


class Phase(enum.Enum):
    """Where an output stands: thinking, answering, or at its start, where a `qwen3` model may open `<think>`."""

    REASONING = "reasoning"
    ANSWER = "answer"
    MAY_OPEN = "may_open"


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    implicit_start: bool  # text before the end tag is reasoning even without the start tag
    start: str = "<think>"
    end: str = "</think>"

    def first_phase(self, prompt: Sequence[Any], start: Any = None, end: Any = None) -> Phase:
        """The phase an output starts in, from its prompt's last tag: `prompt` is the text (tags found as text) or
        the token ids (pass the tags' ids as `start` and `end`)."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        if isinstance(prompt, str):
            opened, closed = prompt.rfind(start), prompt.rfind(end)
        else:
            opened, closed = _last_index(prompt, start), _last_index(prompt, end)
        if opened > closed:
            return Phase.REASONING
        if closed > opened:
            return Phase.ANSWER
        return Phase.REASONING if self.implicit_start else Phase.MAY_OPEN

    def token_ids(self, tokenizer) -> tuple[int, int]:
        """The tags' token ids: each must be one token of the vocabulary (the grammar's gate reads tokens)."""
        ids = []
        for tag in (self.start, self.end):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"reasoning parser {self.name!r}: {tag!r} is not one token of this model's vocabulary "
                    f"({encoded}); the model does not write this syntax (use --reasoning-parser none)"
                )
            ids.append(encoded[0])
        return ids[0], ids[1]


REASONING_PARSERS = {
    "qwen3": ReasoningSyntax("qwen3", implicit_start=False),
    "deepseek_r1": ReasoningSyntax("deepseek_r1", implicit_start=True),
}
SETTINGS = ("auto", "none", *REASONING_PARSERS)  # --reasoning-parser


def resolve_reasoning_parser(setting: str | None, tokenizer) -> ReasoningSyntax | None:
    """`--reasoning-parser` against the model: a named syntax (checked against the vocabulary), none, or for "auto"
    the syntax its chat template writes: `enable_thinking` in it means Qwen3's hybrid syntax, a `<think>` without it
    a template that opens the thinking itself (deepseek_r1); no thinking in it, or the tags not single tokens: none."""
    if setting in (None, "none"):
        return None
    if setting not in SETTINGS:
        raise ValueError(f"reasoning_parser {setting!r}: must be one of {', '.join(SETTINGS)}")
    if setting != "auto":
        syntax = REASONING_PARSERS[setting]
        if tokenizer is None:
            raise ValueError(f"reasoning parser {setting!r} needs the model's tokenizer, and this model has none")
        syntax.token_ids(tokenizer)
        return syntax
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "<think>" not in template and "enable_thinking" not in template:
        return None
    syntax = REASONING_PARSERS["qwen3" if "enable_thinking" in template else "deepseek_r1"]
    try:
        syntax.token_ids(tokenizer)
    except ValueError as e:
        logger.warning("the chat template thinks, but reasoning is not parsed: %s", e)
        return None
    return syntax


def _last_index(items: Sequence[Any], value: Any) -> int:
    for i in range(len(items) - 1, -1, -1):
        if items[i] == value:
            return i
    return -1

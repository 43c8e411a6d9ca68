"""Fields OpenAI or vLLM define that this server does not implement: a 400 naming each, never a silent default.

The rule for every request field: one the server knows is honoured, or refused here when it is
set to anything but its no-op value; a field nobody defines is ignored (clients send extras).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxllm.entrypoints.openai.errors import OpenAIError


def _set(value: Any) -> bool:
    return value is not None


def _true(value: Any) -> bool:
    return value not in (None, False)


NOT_YET = "is not supported yet by this server"

# field → (is it asking for something?, why it is refused)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # vLLM's sampling and request extras
    "use_beam_search": (_true, "is not supported: beam search is not implemented"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "applies to beam search, which is not implemented"),
    "spaces_between_special_tokens": (
        lambda v: v not in (None, True),
        "false is not supported: special tokens are detokenized as the tokenizer decodes them",
    ),
    "allowed_token_ids": (_set, NOT_YET),
    "bad_words": (lambda v: bool(v), NOT_YET),
    "logits_processors": (lambda v: bool(v), "is not supported: no custom logits processors"),
    "return_token_ids": (_true, NOT_YET),
    "cache_salt": (_set, "is not supported: the prefix cache is shared by every request"),
    "vllm_xargs": (lambda v: bool(v), "is not supported: no plugins read extra arguments"),
    "structural_tag": (_set, NOT_YET),
    "guided_decoding_backend": (
        lambda v: v not in (None, "auto", "guidance", "llguidance"),
        "must be 'auto' or 'guidance': structured outputs use llguidance",
    ),
    "mm_processor_kwargs": (lambda v: bool(v), "is not supported: the server serves text models"),
    "prompt_embeds": (_set, "is not supported: prompts are text or token ids"),
    # OpenAI's
    "store": (_true, "is not supported: responses are not stored"),
    "service_tier": (lambda v: v not in (None, "auto", "default"), "must be 'auto' or 'default'"),
    "functions": (_set, "is deprecated by OpenAI and not supported: use 'tools'"),
    "function_call": (_set, "is deprecated by OpenAI and not supported: use 'tool_choice'"),
    "audio": (_set, "is not supported: the server answers in text"),
    "modalities": (lambda v: v is not None and list(v) != ["text"], "must be ['text']: the server answers in text"),
    "reasoning_effort": (_set, "is not supported: the model does not reason"),
    "verbosity": (_set, NOT_YET),
    "web_search_options": (_set, "is not supported: the server has no web search"),
}


def refuse_unsupported(request: Any) -> None:
    """A 400 naming the first known field of `request` this server cannot honour."""
    for name, (asks, why) in REFUSED.items():
        if hasattr(request, name) and asks(getattr(request, name)):
            raise unsupported(name, why)
    best_of = getattr(request, "best_of", None)  # OpenAI's: best of `best_of` samples, `n` returned
    if best_of is not None and best_of != request.n:
        raise unsupported("best_of", f"other than n ({request.n}) {NOT_YET}")


def unsupported(param: str, why: str) -> OpenAIError:
    return OpenAIError(f"'{param}' {why}", status=400, param=param, code="unsupported_parameter")

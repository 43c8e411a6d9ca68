"""Tokenizing off the event loop, and refusing a prompt that cannot fit before tokenizing it.

A long text takes the tokenizer seconds (a 16 MiB prompt: ~11 s), and on the event loop that
stalls every other request. So texts longer than `INLINE_CHARS` are tokenized (and conversations
rendered) on a small thread pool; the Rust tokenizer releases the GIL while it works, so the loop
keeps serving. Shorter ones are tokenized in place: well under a millisecond, less than a hop.

Before any of that, a prompt's length in characters bounds its length in tokens: no token covers
more characters than the longest entry of the vocabulary, so a text longer than `max_model_len`
times that many characters cannot fit and is refused at once (vLLM tokenizes it first). The bound
holds only for tokenizers that never drop or merge characters before matching the vocabulary
(no whitespace-removing pre-tokenizer, no collapsing normalizer); `prompt_char_limit` checks the
tokenizer's pipeline and gives no bound (tokenize, off the loop) for any other.

The tokenizer is shared by these threads, the event loop and the engine's detokenizer: that is
safe because nothing sets its truncation or padding (transformers would then change the Rust
tokenizer's settings, which needs it to itself).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from jaxllm.entrypoints.openai.errors import bad_request

logger = logging.getLogger("jaxllm.server")

T = TypeVar("T")

INLINE_CHARS = 4096  # texts up to this long are tokenized on the event loop

# tokenizer pipeline steps that keep every character (normalizers: how many characters one may merge into)
NORMALIZERS = {"Prepend": 1, "NFD": 1, "Lowercase": 1, "NFC": 3}
PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a prompt of at most `max_model_len` tokens can have, or None when unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        merge = _normalizer_merge(spec.get("normalizer"))
        if merge is None or not _keeps_characters(spec.get("pre_tokenizer")):
            return None
        longest = max(len(token) for token in tokenizer.get_vocab())
    except Exception as e:  # an unusual tokenizer: no bound, only the body limit
        logger.info("no prompt length bound from characters for this tokenizer: %s", e)
        return None
    return max_model_len * longest * merge


def _normalizer_merge(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_normalizer_merge(s) for s in spec.get("normalizers", [])]
        if any(f is None for f in factors):
            return None
        product = 1
        for f in factors:
            product *= f or 1
        return product
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" in pattern and len(content) >= len(pattern["String"]) > 0:
            return 1
        return None
    return NORMALIZERS.get(str(kind))


def _keeps_characters(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(s) for s in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation") and spec.get("behavior") == "Removed":
        return False
    return kind in PRE_TOKENIZERS


class AsyncTokenizer:
    def __init__(self, tokenizer: Any, max_model_len: int, workers: int = 2):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_chars = prompt_char_limit(tokenizer, max_model_len) if tokenizer is not None else None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="jaxllm-tokenize")

    def check_length(self, chars: int, param: str) -> None:
        """Refuse a prompt of `chars` characters that cannot fit in max_model_len tokens."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise bad_request(
                f"{param}: the prompt has {chars} characters, more than any {self.max_model_len}-token prompt "
                f"can have ({self.max_prompt_chars}), so it is longer than this model's maximum context length "
                f"of {self.max_model_len} tokens",
                param=param,
            )

    async def run(self, chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the pool when it works on more than INLINE_CHARS characters, else here."""
        if chars <= INLINE_CHARS:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(len(text), self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        return await self.run(len(ids) * 4, self.tokenizer.decode, ids)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

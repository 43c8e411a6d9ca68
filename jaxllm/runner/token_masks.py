"""The `allowed` token bitmask rows the host fills for the sampler (structured outputs, `min_tokens`' banned EOS):
32 tokens a uint32 word, bit t % 32 of word t // 32 set where token t may be sampled. Plain numpy, no JAX."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

ALL_ALLOWED = np.uint32(0xFFFFFFFF)  # a mask word with every token allowed


def mask_words(vocab_size: int) -> int:
    """Words of 32 token bits in one row of `allowed`: ceil(vocab_size / 32)."""
    return -(-vocab_size // 32)


def all_allowed(vocab_size: int, num_rows: int | None = None) -> np.ndarray:
    """A fresh `allowed` row [W] (or rows [num_rows, W]) with every token allowed."""
    shape = (mask_words(vocab_size),) if num_rows is None else (num_rows, mask_words(vocab_size))
    return np.full(shape, ALL_ALLOWED, np.uint32)


def ban_tokens(row_words: np.ndarray, token_ids: Iterable[int]) -> np.ndarray:
    """Clear the bits of `token_ids` in one `allowed` row, in place (a view into a batch works); returns it."""
    ids = np.asarray(list(token_ids), np.int64)
    if ids.size:
        if ids.min() < 0 or ids.max() >= 32 * row_words.shape[-1]:
            raise ValueError(f"token ids must be in [0, {32 * row_words.shape[-1]}), got {ids.tolist()}")
        clear = ~(np.uint32(1) << (ids % 32).astype(np.uint32))
        np.bitwise_and.at(row_words, ids // 32, clear)
    return row_words


def allow_only(vocab_size: int, token_ids: Iterable[int]) -> np.ndarray:
    """An `allowed` row [W] in which only `token_ids` may be sampled (e.g. from a grammar)."""
    row = np.zeros(mask_words(vocab_size), np.uint32)
    ids = np.asarray(list(token_ids), np.int64)
    if ids.size:
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}), got {ids.tolist()}")
        np.bitwise_or.at(row, ids // 32, np.uint32(1) << (ids % 32).astype(np.uint32))
    return row


def allowed_token_ids(row_words: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids an `allowed` row permits (for checks and debugging)."""
    bits = (row_words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab_size])

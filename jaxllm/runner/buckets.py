"""The compiled shapes: one bucket per token count, each with its sequence-row count.

Token buckets are powers of two from 1 up to `max_num_batched_tokens` (which is always
one), as vLLM's CUDA-graph sizes are: a batch-1 decode must not pay for 16 padded rows
of weight reads and matmuls. A bucket of T tokens has min(T, max_num_seqs) sequence rows,
rounded up to a power of two — a step never has more sequences than tokens, so pairing
every token count with every sequence count would compile shapes that cannot occur.
The number of compilations is the number of token buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 1


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int
    num_seqs: int


def _pow2_at_least(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def make_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> list[Bucket]:
    sizes = []
    size = MIN_TOKENS
    while size < max_num_batched_tokens:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_batched_tokens)
    return [Bucket(t, _pow2_at_least(min(t, max_num_seqs))) for t in sizes]


def pick_bucket(buckets: list[Bucket], num_tokens: int, num_seqs: int) -> Bucket:
    for bucket in buckets:
        if bucket.num_tokens >= num_tokens and bucket.num_seqs >= num_seqs:
            return bucket
    raise ValueError(f"no bucket holds {num_tokens} tokens and {num_seqs} sequences (largest: {buckets[-1]})")

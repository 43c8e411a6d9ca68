"""The compiled shapes: one bucket per token count, each with its sequence-row count (rows of logits).

Token buckets are powers of two from 1 up to `max_num_batched_tokens` (which is always
one), as vLLM's CUDA-graph sizes are: a batch-1 decode must not pay for 16 padded rows
of weight reads and matmuls. A bucket of T tokens has min(T, max_num_seqs) rows of logits,
rounded up to a power of two — a step never has more rows than tokens, so pairing every
token count with every row count would compile shapes that cannot occur.

Speculation: a decode verifying d drafts takes d + 1 rows, so a step can have more rows than
sequences (up to `max_rows`, vLLM's max_num_seqs * (k + 1)). Rows cost logits and sampling
for every padded row, so a prefill must not pay for them: a token bucket whose rows would grow
gets a second bucket of the same tokens and min(T, max_rows) rows (rounded up likewise), used
only by steps whose rows do not fit the first. Without speculation there is one per token count.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 1


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int
    num_seqs: int  # rows of logits (a sequence's, or a draft's)


def _pow2_at_least(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def make_buckets(max_num_batched_tokens: int, max_num_seqs: int, max_rows: int | None = None) -> list[Bucket]:
    """Sorted by (tokens, rows): `pick_bucket` takes the first that holds a step. `max_rows` (speculation): the
    most rows of logits a step has, above `max_num_seqs`: each token bucket that could hold more rows than its
    plain one gets a second bucket with them."""
    sizes = []
    size = MIN_TOKENS
    while size < max_num_batched_tokens:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_batched_tokens)
    buckets = []
    for t in sizes:
        plain = Bucket(t, _pow2_at_least(min(t, max_num_seqs)))
        buckets.append(plain)
        if max_rows is not None and (wide := _pow2_at_least(min(t, max_rows))) > plain.num_seqs:
            buckets.append(Bucket(t, wide))
    return sorted(buckets)


def pick_bucket(buckets: list[Bucket], num_tokens: int, num_seqs: int) -> Bucket:
    for bucket in buckets:
        if bucket.num_tokens >= num_tokens and bucket.num_seqs >= num_seqs:
            return bucket
    raise ValueError(f"no bucket holds {num_tokens} tokens and {num_seqs} sequences (largest: {buckets[-1]})")

"""Pure-jnp ragged paged attention: the oracle for the Pallas kernels and the CPU fast path.

The batch is cut into query tiles (`plan.py`): a tile is up to `block_q` rows of one
sequence. A tile's keys are a range of whole KV blocks, read through its block table in
*chunks* of `chunk_tokens` keys (whole blocks; 64 by default: tuned on a 2-core x86 CPU,
where 64 to 128 were best and 256+ slower). Every (tile, chunk) pair that some row needs is one *work
item*; the items of the whole batch are numbered 0..W-1 (W is a traced value), and a while
loop consumes them `items_per_step` at a time. So:

- nothing past a sequence's last needed block is read (the bound comes from `kv_lens` and
  the sliding window, never from the table's width), and a short sequence does not wait
  for the batch's longest one: the work is the sum of the contexts, not their maximum
  times the batch;
- one compiled function serves every context length and every mix of prefill and decode;
- prefill rows of one sequence share the gathered keys of their tile.

Each item produces a partial flash-attention state (running max, sum, unnormalised output)
for its tile; states are merged into the tile's by a scatter-max and a scatter-add (online
softmax across items). Softmax statistics and accumulation are float32.

`ragged_paged_attention_dense` is the naive version kept for the benchmark: it gathers every
block of every table (up to `max_blocks`) and masks. On the CPU benchmark
(`benchmarks/results/kernel_bench_cpu.json`) this reference is 3-5x faster than it on
uniform decode batches and 15-18x on skewed-context and mixed batches (dense is skipped
on the prefill case, where its gather alone would take 1.5 GiB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention.plan import cache_dims, make_tile_plan

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def default_block_q(num_tokens: int, max_seqs: int) -> int:
    """Query rows per tile: 1 for decode-like buckets, more when the bucket has prefill room."""
    ratio = max(1, num_tokens // max(1, max_seqs))
    block_q = 1
    while block_q * 2 <= min(ratio, 16):
        block_q *= 2
    return block_q


def _gather_blocks(cache, layer, blocks):
    """cache[(layer,) blocks] without slicing the layer out of a stacked cache first."""
    if cache.ndim == 5:
        return cache[layer, blocks]
    return cache[blocks]


def ragged_paged_attention_reference(
    q: Float[Array, "T Hq D"],
    k_cache: Float[Array, "*L N B Hkv D"],
    v_cache: Float[Array, "*L N B Hkv D"],
    kv_lens: Int[Array, " S"],
    block_tables: Int[Array, "S M"],
    cu_q_lens: Int[Array, " S1"],
    num_seqs: Int[Array, " 1"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Float[Array, " Hq"] | None = None,
    layer: Int[Array, ""] | int | None = None,
    chunk_tokens: int = 64,
    block_q: int | None = None,
    items_per_step: int | None = None,
) -> Float[Array, "T Hq D"]:
    q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs = map(
        jnp.asarray, (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache_dims(k_cache, layer)
    group = num_q_heads // num_kv_heads
    max_seqs, max_blocks = block_tables.shape
    if block_q is None:
        block_q = default_block_q(num_tokens, max_seqs)
    chunk_blocks = max(1, min(max_blocks, chunk_tokens // block_size))
    chunk = chunk_blocks * block_size  # keys per work item

    plan = make_tile_plan(
        cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens, block_q=block_q, sliding_window=sliding_window
    )
    num_tiles = plan.seq.shape[0]
    per_step = items_per_step or num_tiles

    # Work items: (tile, chunk) pairs, numbered in tile order.
    first_block = plan.key_lo // block_size
    last_block = jnp.minimum(jnp.maximum(plan.key_hi - 1, 0) // block_size, max_blocks - 1)
    span = plan.key_hi - first_block * block_size
    n_items = jnp.where(plan.key_hi > plan.key_lo, (span + chunk - 1) // chunk, 0)
    item_end = jnp.cumsum(n_items, dtype=jnp.int32)
    total_items = item_end[-1]

    # Query tiles [NT, BQ, Hkv, G, D], pre-scaled; rows past a tile's end are masked below.
    slot = jnp.arange(block_q, dtype=jnp.int32)
    rows = jnp.minimum(plan.row0[:, None] + slot, num_tokens - 1)
    q_tiles = (q[rows].astype(jnp.float32) * sm_scale).reshape(num_tiles, block_q, num_kv_heads, group, head_dim)
    row_pos = plan.pos0[:, None] + slot  # [NT, BQ]
    row_ok = slot[None, :] < plan.nrows[:, None]
    tables = block_tables.astype(jnp.int32)

    def body(carry):
        step, m, denom, acc = carry
        w = step * per_step + jnp.arange(per_step, dtype=jnp.int32)
        ok = w < total_items
        tile = jnp.minimum(jnp.searchsorted(item_end, w, side="right").astype(jnp.int32), num_tiles - 1)
        tile = jnp.where(ok, tile, 0)
        c = w - (item_end[tile] - n_items[tile])
        block_idx = (first_block[tile] + c * chunk_blocks)[:, None] + jnp.arange(chunk_blocks, dtype=jnp.int32)
        # past a tile's last needed block, re-read that block (masked): nothing else is touched
        blocks = tables[plan.seq[tile][:, None], jnp.minimum(block_idx, last_block[tile][:, None])]  # [P, C]
        key = (block_idx * block_size)[:, :, None] + jnp.arange(block_size, dtype=jnp.int32)
        key = key.reshape(per_step, chunk)  # [P, K]
        key_ok = ok[:, None] & (key >= plan.key_lo[tile][:, None]) & (key < plan.key_hi[tile][:, None])

        kv_shape = (per_step, chunk, num_kv_heads, head_dim)
        k = _gather_blocks(k_cache, layer, blocks).reshape(kv_shape)
        v = _gather_blocks(v_cache, layer, blocks).reshape(kv_shape)
        # Blocks no row needs (and past the table) may hold NaN: never let them reach a dot.
        k = jnp.where(key_ok[:, :, None, None], k, 0).astype(jnp.float32)
        v = jnp.where(key_ok[:, :, None, None], v, 0).astype(jnp.float32)

        pos = row_pos[tile][:, :, None]  # [P, BQ, 1]
        mask = key_ok[:, None, :] & row_ok[tile][:, :, None] & (key[:, None, :] <= pos)
        if sliding_window is not None:
            mask &= key[:, None, :] > pos - sliding_window
        mask = mask[:, :, None, None, :]  # [P, BQ, 1, 1, K]

        s = jnp.einsum("pqhgd,pkhd->pqhgk", q_tiles[tile], k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, MASK_VALUE)
        m_item = s.max(-1)
        p = jnp.where(mask, jnp.exp(s - m_item[..., None]), 0.0)
        l_item = p.sum(-1)
        acc_item = jnp.einsum("pkhd,pqhgk->pqhgd", v, p)  # V as lhs: ~1.5x faster on XLA CPU

        dst = jnp.where(ok, tile, num_tiles)  # idle items merge into a sink row
        m_new = m.at[dst].max(m_item)
        alpha = jnp.exp(m - m_new)
        beta = jnp.exp(m_item - m_new[dst])
        denom = (denom * alpha).at[dst].add(l_item * beta)
        acc = (acc * alpha[..., None]).at[dst].add(acc_item * beta[..., None])
        return step + 1, m_new, denom, acc

    stats = jnp.full((num_tiles + 1, block_q, num_kv_heads, group), MASK_VALUE, jnp.float32)
    init = (jnp.int32(0), stats, jnp.zeros_like(stats), jnp.zeros((*stats.shape, head_dim), jnp.float32))
    _, m, denom, acc = jax.lax.while_loop(lambda c: c[0] * per_step < total_items, body, init)
    if sinks is not None:  # a logit per head in the denominator only
        denom = denom + jnp.exp(jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group) - m)

    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [NT+1, BQ, Hkv, G, D]
    out = out[plan.row_tile, plan.row_slot].reshape(num_tokens, num_q_heads, head_dim)
    out = jnp.where(plan.row_real[:, None, None], out, 0.0)
    return out.astype(q.dtype)


def ragged_paged_attention_dense(
    q: Float[Array, "T Hq D"],
    k_cache: Float[Array, "*L N B Hkv D"],
    v_cache: Float[Array, "*L N B Hkv D"],
    kv_lens: Int[Array, " S"],
    block_tables: Int[Array, "S M"],
    cu_q_lens: Int[Array, " S1"],
    num_seqs: Int[Array, " 1"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Float[Array, " Hq"] | None = None,
    layer: Int[Array, ""] | int | None = None,
) -> Float[Array, "T Hq D"]:
    """Naive version: every row gathers all `max_blocks` blocks of its table and masks."""
    q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs = map(
        jnp.asarray, (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = cache_dims(k_cache, layer)
    group = num_q_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    plan = make_tile_plan(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens, block_q=1, sliding_window=sliding_window)
    seq = plan.seq[plan.row_tile]
    pos = plan.pos0[plan.row_tile]
    kv_len = jnp.where(plan.row_real, plan.kv_len[plan.row_tile], 0)
    shape = (num_tokens, max_blocks * block_size, num_kv_heads, head_dim)
    k = _gather_blocks(k_cache, layer, block_tables[seq]).reshape(shape).astype(jnp.float32)
    v = _gather_blocks(v_cache, layer, block_tables[seq]).reshape(shape).astype(jnp.float32)
    key = jnp.arange(max_blocks * block_size)
    mask = (key[None] <= pos[:, None]) & (key[None] < kv_len[:, None])
    if sliding_window is not None:
        mask &= key[None] > pos[:, None] - sliding_window
    k = jnp.where(mask[..., None, None], k, 0.0)
    v = jnp.where(mask[..., None, None], v, 0.0)
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    s = jnp.einsum("thgd,tkhd->thgk", qg, k)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
    top = s.max(-1, keepdims=True)
    p = jnp.where(mask[:, None, None, :], jnp.exp(s - top), 0.0)
    denom = p.sum(-1)
    if sinks is not None:
        denom = denom + jnp.exp(jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group) - top[..., 0])
    out = jnp.einsum("thgk,tkhd->thgd", p, v) / jnp.maximum(denom, 1e-30)[..., None]
    out = jnp.where(plan.row_real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

"""Host-side (traced jnp) work plan shared by every ragged paged-attention backend.

The ragged batch is cut into *query tiles*: up to `block_q` consecutive query rows of ONE
sequence. A decode token is a tile of one row; a prefill chunk of n rows is `ceil(n/block_q)`
tiles. The number of tiles is data dependent, but bounded by a static number (`max_tiles`),
so one compiled function serves every mix of prefill and decode in a bucket; tiles past the
real count are empty (`nrows == 0`) and cost a few scalar loads.

Each tile carries what a backend needs to fetch exactly the keys its rows attend to:
the sequence, the first query row, the absolute position of that row, and the key range
`[key_lo, key_hi)` (causal end of the last row; start of the sliding window of the first
row). Keys are then read block by block through the sequence's block table, from block
`key_lo // block_size` to block `(key_hi - 1) // block_size`: a bound taken from `kv_lens`,
never from the table's width.

The same plan drives the pure-jnp reference (CPU) and the Pallas kernel (GPU), which keeps
the host-side contract independent of the kernel language.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Int


class TilePlan(NamedTuple):
    seq: Int[Array, " NT"]  # sequence of the tile (0 for an empty tile)
    row0: Int[Array, " NT"]  # first query row of the tile in q
    nrows: Int[Array, " NT"]  # real rows in the tile (0: empty tile)
    pos0: Int[Array, " NT"]  # absolute position of the tile's first row
    kv_len: Int[Array, " NT"]  # the sequence's context length
    key_lo: Int[Array, " NT"]  # first key any row of the tile needs
    key_hi: Int[Array, " NT"]  # one past the last key any row of the tile needs
    row_tile: Int[Array, " T"]  # for each query row: its tile
    row_slot: Int[Array, " T"]  # for each query row: its index within the tile
    row_real: Array  # bool [T]: the row belongs to a sequence < num_seqs


def max_tiles(num_tokens: int, max_seqs: int, block_q: int) -> int:
    """Static upper bound of sum_i ceil(q_len_i / block_q) over a bucket."""
    n = min(max_seqs, num_tokens)
    return max(1, min(num_tokens, (num_tokens + n * (block_q - 1)) // block_q))


def _searchsorted(sorted_arr, x):
    """searchsorted(side="right") without a device while loop when sizes are small (GPU-friendly)."""
    method = "compare_all" if sorted_arr.size * x.size <= 1 << 21 else "scan"
    return jnp.searchsorted(sorted_arr, x, side="right", method=method).astype(jnp.int32)


def make_tile_plan(
    cu_q_lens: Int[Array, " S1"],
    kv_lens: Int[Array, " S"],
    num_seqs: Int[Array, " 1"],
    *,
    num_tokens: int,
    block_q: int,
    sliding_window: int | None = None,
) -> TilePlan:
    max_seqs = kv_lens.shape[0]
    num_tiles = max_tiles(num_tokens, max_seqs, block_q)
    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    n_seqs = jnp.reshape(num_seqs, (-1,))[0].astype(jnp.int32)

    active = jnp.arange(max_seqs, dtype=jnp.int32) < n_seqs
    q_start = cu[:-1]
    q_len = jnp.where(active, jnp.maximum(cu[1:] - q_start, 0), 0)
    tiles_per_seq = (q_len + block_q - 1) // block_q
    tile_end = jnp.cumsum(tiles_per_seq, dtype=jnp.int32)
    tile_begin = tile_end - tiles_per_seq

    t = jnp.arange(num_tiles, dtype=jnp.int32)
    valid = t < tile_end[-1]
    seq = _searchsorted(tile_end, t)
    seq = jnp.where(valid, jnp.minimum(seq, max_seqs - 1), 0)
    local = t - tile_begin[seq]
    row0 = jnp.where(valid, q_start[seq] + local * block_q, 0)
    nrows = jnp.where(valid, jnp.minimum(block_q, q_start[seq] + q_len[seq] - row0), 0)
    kv_len = jnp.where(valid, kv_lens[seq], 0)
    pos0 = kv_len - q_len[seq] + local * block_q
    key_hi = jnp.where(valid, pos0 + nrows, 0)
    if sliding_window is None:
        key_lo = jnp.zeros_like(key_hi)
    else:
        key_lo = jnp.maximum(pos0 - sliding_window + 1, 0)
    key_lo = jnp.minimum(key_lo, key_hi)

    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    row_seq = _searchsorted(cu[1:], rows)
    row_real = (rows < cu[n_seqs]) & (row_seq < max_seqs)
    row_seq = jnp.where(row_real, row_seq, 0)
    local_row = rows - q_start[row_seq]
    row_tile = jnp.where(row_real, tile_begin[row_seq] + local_row // block_q, 0)
    row_slot = jnp.where(row_real, local_row % block_q, 0)
    return TilePlan(seq, row0, nrows, pos0, kv_len, key_lo, key_hi, row_tile, row_slot, row_real)


def cache_dims(k_cache, layer) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of a 4-D or layer-stacked 5-D cache."""
    if k_cache.ndim == 5:
        if layer is None:
            raise ValueError(f"a layer-stacked cache {k_cache.shape} needs `layer`")
        return k_cache.shape[1:]
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [N, B, Hkv, D] or [L, N, B, Hkv, D], got {k_cache.shape}")
    if layer is not None:
        raise ValueError(f"`layer` given but the cache {k_cache.shape} holds one layer")
    return k_cache.shape


def check_inputs(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, layer) -> None:
    """Static shape checks with messages that name the argument and the limit."""
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    _, _, num_kv_heads, head_dim = cache_dims(k_cache, layer)
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got {q.shape}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of KV heads {num_kv_heads}")
    max_seqs = kv_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != max_seqs:
        raise ValueError(f"block_tables must be [{max_seqs}, max_blocks], got {block_tables.shape}")
    if cu_q_lens.shape != (max_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [{max_seqs + 1}], got {cu_q_lens.shape}")

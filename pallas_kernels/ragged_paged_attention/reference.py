"""Pure-jnp ragged paged attention: the oracle for the Pallas kernels and the CPU fast path.

Each query row gathers only the KV blocks of its own sequence, a chunk of blocks at a
time, inside a while loop whose trip count is the batch's longest context (a traced
value): nothing past what the batch needs is read, and one compiled function serves
every context length. Softmax is online (flash style) in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def token_metadata(cu_q_lens: Int[Array, "S1"], kv_lens: Int[Array, "S"], num_seqs: Int[Array, "1"], num_tokens: int):
    """Per query row: its sequence, absolute position and context length (0 for padding rows)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    max_seqs = kv_lens.shape[0]
    seq_id = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    real = (rows < cu_q_lens[num_seqs[0]]) & (seq_id < max_seqs)
    seq_id = jnp.where(real, seq_id, 0)
    kv_len = jnp.where(real, kv_lens[seq_id], 0)
    position = kv_len - (cu_q_lens[seq_id + 1] - rows)
    return seq_id, position, kv_len


def ragged_paged_attention_reference(
    q: Float[Array, "T Hq D"],
    k_cache: Float[Array, "*L N B Hkv D"],
    v_cache: Float[Array, "*L N B Hkv D"],
    kv_lens: Int[Array, "S"],
    block_tables: Int[Array, "S M"],
    cu_q_lens: Int[Array, "S1"],
    num_seqs: Int[Array, "1"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: Int[Array, ""] | int | None = None,
    chunk_blocks: int = 8,
) -> Float[Array, "T Hq D"]:
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[-3], k_cache.shape[-2]
    group = num_q_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    chunk_blocks = min(chunk_blocks, max_blocks)
    chunk_tokens = chunk_blocks * block_size

    seq_id, position, kv_len = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    first_key = jnp.zeros_like(position) if sliding_window is None else position - sliding_window + 1
    tables = block_tables[seq_id]  # [T, M]
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale

    def gather(cache, blocks):
        if layer is None:
            return cache[blocks]
        return cache[layer, blocks]

    def body(carry):
        chunk, m, l, acc = carry
        block_idx = chunk * chunk_blocks + jnp.arange(chunk_blocks)
        blocks = tables[:, jnp.minimum(block_idx, max_blocks - 1)]  # [T, C]
        key_pos = chunk * chunk_tokens + jnp.arange(chunk_tokens)
        mask = (key_pos[None] <= position[:, None]) & (key_pos[None] >= first_key[:, None])
        mask &= key_pos[None] < kv_len[:, None]  # [T, K]
        shape = (num_tokens, chunk_tokens, num_kv_heads, head_dim)
        k = gather(k_cache, blocks).reshape(shape).astype(jnp.float32)
        v = gather(v_cache, blocks).reshape(shape).astype(jnp.float32)
        k = jnp.where(mask[..., None, None], k, 0.0)  # unused blocks may hold NaN
        v = jnp.where(mask[..., None, None], v, 0.0)
        s = jnp.einsum("thgd,tkhd->thgk", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask4 = mask[:, None, None, :]
        s = jnp.where(mask4, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask4, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("thgk,tkhd->thgd", p, v)
        return chunk + 1, m_new, l, acc

    num_chunks = (jnp.max(kv_len) + chunk_tokens - 1) // chunk_tokens
    stats = jnp.full((num_tokens, num_kv_heads, group), MASK_VALUE, jnp.float32)
    init = (jnp.int32(0), stats, jnp.zeros_like(stats), jnp.zeros_like(qg))
    _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < num_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

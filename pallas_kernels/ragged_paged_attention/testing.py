"""Random ragged batches over a hostile paged cache, and a float64 numpy oracle.

Used by the kernel tests and the benchmarks. The cache is built so that reading anything a
sequence does not own shows: every block no sequence needs is NaN, every table entry past a
sequence's last needed block (or before its sliding window) points at a NaN block, the tail
of each sequence's last block holds large stale finite values, padding rows of `q` are NaN,
and sequence entries past `num_seqs` are padding (kv_len 0, cu_q_lens repeated, tables
pointing at NaN blocks). With several layers, every layer holds different data.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # [T, Hq, D]
    k_cache: np.ndarray  # [(L,) N, B, Hkv, D]
    v_cache: np.ndarray
    kv_lens: np.ndarray  # int32 [S]
    block_tables: np.ndarray  # int32 [S, M]
    cu_q_lens: np.ndarray  # int32 [S + 1]
    num_seqs: np.ndarray  # int32 [1]
    q_lens: list[int]
    layer: int | None = None

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.kv_lens, self.block_tables, self.cu_q_lens, self.num_seqs)

    def kv_bytes_needed(self, sliding_window: int | None = None) -> int:
        """Bytes of K and V the batch's real rows attend to (one layer)."""
        *_, hkv, d = self.k_cache.shape
        keys = 0
        # kv_lens is padded to max_seqs; the batch's real sequences are the first len(q_lens)
        for q_len, kv_len in zip(self.q_lens, self.kv_lens, strict=False):
            lo = 0 if sliding_window is None else max(0, kv_len - q_len - sliding_window + 1)
            keys += int(kv_len) - lo
        return 2 * keys * hkv * d * self.k_cache.dtype.itemsize


def _fill(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def make_batch(
    rng: np.random.Generator,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=np.float32,
    max_seqs: int | None = None,
    num_tokens: int | None = None,
    max_blocks: int | None = None,
    spare_blocks: int = 4,
    num_blocks: int | None = None,
    num_layers: int | None = None,
    layer: int | None = None,
    sliding_window: int | None = None,
    q_scale: float = 2.0,
    hostile: bool = True,
) -> Batch:
    """A ragged batch; sequence i has q_lens[i] new rows and kv_lens[i] keys (incl. the new ones).

    Fixing `max_seqs`, `num_tokens`, `max_blocks` and `num_blocks` gives batches of different
    composition the same shapes, so one compiled function serves them all (as in serving).
    """
    dtype = np.dtype(dtype)
    n = len(q_lens)
    assert len(kv_lens) == n and all(0 < ql <= kl for ql, kl in zip(q_lens, kv_lens, strict=True))
    max_seqs = max_seqs or n + 2
    num_tokens = num_tokens or sum(q_lens) + 3
    assert max_seqs >= n and num_tokens >= sum(q_lens)
    need_hi = [(kl - 1) // block_size + 1 for kl in kv_lens]  # blocks 0..hi-1 hold the context
    need_lo = [
        0 if sliding_window is None else max(0, kl - ql - sliding_window + 1) // block_size
        for ql, kl in zip(q_lens, kv_lens, strict=True)
    ]
    max_blocks = max_blocks or max(need_hi) + 2
    assert max_blocks >= max(need_hi)
    used = sum(hi - lo for lo, hi in zip(need_lo, need_hi, strict=True))
    if num_blocks is None:
        num_blocks = used + spare_blocks
    assert num_blocks > used, f"num_blocks={num_blocks} leaves no spare block for {used} used ones"
    perm = rng.permutation(num_blocks)
    real_blocks, nan_blocks = perm[:used], perm[used:]

    layers = 1 if num_layers is None else num_layers
    cache_shape = (layers, num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = _fill(rng, cache_shape, dtype)
    v_cache = _fill(rng, cache_shape, dtype)
    tables = np.zeros((max_seqs, max_blocks), np.int32)
    tables[:] = rng.choice(nan_blocks, size=tables.shape) if hostile else 0
    cursor = 0
    for i, (lo, hi, kl) in enumerate(zip(need_lo, need_hi, kv_lens, strict=True)):
        tables[i, lo:hi] = real_blocks[cursor : cursor + hi - lo]
        cursor += hi - lo
        if hostile:  # stale but finite garbage past the context in the last block
            tail = kl - (hi - 1) * block_size
            last = tables[i, hi - 1]
            k_cache[:, last, tail:] = _fill(rng, k_cache[:, last, tail:].shape, dtype, 100.0)
            v_cache[:, last, tail:] = _fill(rng, v_cache[:, last, tail:].shape, dtype, 100.0)
    if hostile:
        k_cache[:, nan_blocks] = np.nan
        v_cache[:, nan_blocks] = np.nan
    if num_layers is None:
        k_cache, v_cache = k_cache[0], v_cache[0]
    else:
        assert layer is not None and 0 <= layer < num_layers

    q = np.full((num_tokens, num_q_heads, head_dim), np.nan if hostile else 0.0, np.float32)
    total = sum(q_lens)
    q[:total] = _fill(rng, (total, num_q_heads, head_dim), np.float32, q_scale)
    q = q.astype(dtype)
    cu = np.full(max_seqs + 1, total, np.int32)
    cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.zeros(max_seqs, np.int32)
    kv[:n] = kv_lens
    return Batch(
        q,
        k_cache,
        v_cache,
        kv,
        tables,
        cu,
        np.array([n], np.int32),
        list(q_lens),
        layer if num_layers is not None else None,
    )


def reference_f64(
    batch: Batch,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Float64 attention of every real row, computed from the stored (rounded) values; `sinks` (a logit per query
    head) join the softmax as one more column whose value is dropped, as transformers' gpt-oss writes it."""
    q = batch.q.astype(np.float64)
    k_cache = batch.k_cache if batch.layer is None else batch.k_cache[batch.layer]
    v_cache = batch.v_cache if batch.layer is None else batch.v_cache[batch.layer]
    _, block_size, hkv, d = k_cache.shape
    t, hq, _ = q.shape
    group = hq // hkv
    out = np.zeros((t, hq, d))
    for i, q_len in enumerate(batch.q_lens):
        kv_len = int(batch.kv_lens[i])
        start = int(batch.cu_q_lens[i])
        lo = 0 if sliding_window is None else max(0, kv_len - q_len - sliding_window + 1)
        blocks = batch.block_tables[i, lo // block_size : (kv_len - 1) // block_size + 1]
        k = k_cache[blocks].reshape(-1, hkv, d).astype(np.float64)
        v = v_cache[blocks].reshape(-1, hkv, d).astype(np.float64)
        first = (lo // block_size) * block_size
        keys = first + np.arange(k.shape[0])
        for j in range(q_len):
            pos = kv_len - q_len + j
            ok = keys <= pos
            if sliding_window is not None:
                ok &= keys > pos - sliding_window
            qg = q[start + j].reshape(hkv, group, d)
            s = np.einsum("hgd,khd->hgk", qg, k[ok]) * sm_scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            if sinks is not None:
                s = np.concatenate([s, np.asarray(sinks, np.float64).reshape(hkv, group, 1)], axis=-1)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            p = p[..., :-1] if sinks is not None else p
            out[start + j] = np.einsum("hgk,khd->hgd", p, v[ok]).reshape(hq, d)
    return out


def relative_error(out, ref: np.ndarray, q_lens: list[int]) -> float:
    """Worst (row, head) relative L2 error over the real rows."""
    n = sum(q_lens)
    out = np.asarray(out, np.float64)[:n]
    ref = ref[:n]
    num = np.linalg.norm(out - ref, axis=-1)
    den = np.maximum(np.linalg.norm(ref, axis=-1), 1e-6)
    return float(np.max(num / den))

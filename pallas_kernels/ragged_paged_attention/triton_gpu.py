"""Ragged paged attention as a Pallas kernel for NVIDIA GPUs, on the Pallas *Triton* backend.

Why Triton and not Mosaic GPU
-----------------------------
JAX 0.11 deprecated Pallas Triton in favour of Mosaic GPU, and a Hopper-specific Mosaic GPU
body (TMA page loads, warp specialisation) is the natural next step. We still write this
kernel for Triton, deliberately, for three measured or checked reasons:

1. It can be verified without a GPU. On a CPU-only machine, `jax.jit(f).trace(*args)
   .lower(lowering_platforms=("cuda",))` runs the full Pallas-to-Triton-IR lowering of a
   Triton kernel (JAX's own `ops.gpu.paged_attention` included) and fails loudly on any
   unsupported op, shape or index; a Mosaic GPU kernel fails to lower at all without a
   GPU. Our CI has no GPU, so Triton is the backend whose *compiled* form the tests cover
   (`tests/kernels/test_ragged_paged_attention.py::test_lowers_for_cuda`), besides the
   interpret-mode numerics checks that cover both.
2. Paged KV needs gathers: a tile of keys is `C` blocks picked through the block table.
   Triton lowers a ref indexed by a vector of block ids to one pointer gather (coalesced
   along head_dim), on every NVIDIA generation the engine may meet (A100 and H100/H200);
   Mosaic GPU wants TMA/async copies of statically known tiles per page, which is
   Hopper-first and would need a per-page copy pipeline written by hand.
3. Both JAX lines the project supports (0.10 on CPU, 0.11.x on the lent GPU) ship it, and
   passing Triton `CompilerParams` explicitly selects it whatever the default GPU backend.

The host-side contract is backend independent: `plan.py` turns the ragged batch into query
tiles (shared with the jnp reference), the wrapper below packs per-tile metadata and query
tiles, and the kernel only sees `(tile, kv_head, kv_split)` programs. A Mosaic GPU body can
replace `_kernel` behind the same wrapper.

The kernel
----------
Grid `(tile, kv_head, kv_split)`. A tile is up to `block_q` query rows of one sequence; its
rows times the GQA query heads of one KV head (padded to a power of two) form the `M` rows
of the matmuls, so the heads that share a KV head are computed together and each KV block
is read once per (tile, KV head). The program walks its share of the tile's key range in
chunks of `chunk_blocks` blocks: block ids come from the block table (indices clamped to
the tile's last needed block, ids clamped into the cache), K and V are gathered straight
from the cache (`[N, B, Hkv, D]` or the layer-stacked `[L, N, B, Hkv, D]`, layer read from
a scalar input, so the model's scanned cache is never sliced), and an online (flash)
softmax in float32 accumulates the output.
Loop bounds come from the tile's key range (`kv_lens`, causality, sliding window), never
from `max_blocks`. Keys outside that range are zeroed before any dot (they may be NaN) and
masked to -0.7*f32max; padding rows are masked the same way and their results are dropped.
With `num_kv_splits > 1` (flash decoding) each split writes an unnormalised partial result
and its softmax statistics, merged by a few jnp ops afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention.plan import TilePlan, cache_dims, make_tile_plan

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

try:  # Pallas Triton: `CompilerParams` since JAX 0.7, `TritonCompilerParams` before.
    from jax.experimental.pallas import triton as _pltriton

    _TritonParams = getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams", None)
except ImportError:  # a JAX without the Triton backend: interpret mode still works
    _TritonParams = None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def supports(q, k_cache, layer) -> bool:
    """Whether the Triton kernel can tile this head layout (powers of two, dots >= 16)."""
    _, block_size, _, head_dim = cache_dims(k_cache, layer)
    pow2 = lambda n: n > 0 and not n & (n - 1)  # noqa: E731
    return pow2(block_size) and pow2(head_dim) and head_dim >= 16 and _TritonParams is not None


def default_config(
    num_tokens: int, max_seqs: int, num_q_heads: int, num_kv_heads: int, block_size: int, max_blocks: int
) -> dict:
    """Static tiling for a bucket (num_tokens, max_seqs); all values are powers of two."""
    group_p = _next_pow2(num_q_heads // num_kv_heads)
    decode_like = num_tokens <= 2 * max_seqs
    block_m = max(16, group_p) if decode_like else max(64, group_p)
    block_q = max(1, block_m // group_p)
    chunk_blocks = max(1, 64 // block_size) if decode_like else max(1, 32 // block_size)
    chunk_blocks = max(chunk_blocks, -(-16 // block_size))  # a dot needs >= 16 keys
    tiles = num_tokens if block_q == 1 else num_tokens // block_q + max_seqs
    programs = max(1, min(tiles, max_seqs if decode_like else tiles)) * num_kv_heads
    max_context = max_blocks * block_size
    splits = 1
    while programs * splits < 512 and splits < 16 and max_context // (splits * 2) >= 512:
        splits *= 2
    return dict(
        block_q=block_q,
        chunk_blocks=chunk_blocks,
        num_kv_splits=splits,
        num_warps=4 if block_m <= 16 else 8,
        num_stages=2,
    )


def _kernel(
    meta_ref,
    layer_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *stat_refs,
    sm_scale,
    sliding_window,
    soft_cap,
    group,
    group_p,
    chunk_blocks,
    num_kv_splits,
    write_stats,
):
    head = pl.program_id(1)
    split = pl.program_id(2)
    block_m, head_dim = q_ref.shape
    num_blocks, block_size = k_ref.shape[-4], k_ref.shape[-3]
    max_blocks = tables_ref.shape[1]
    chunk = chunk_blocks * block_size

    seq = meta_ref[0]
    nrows = meta_ref[1]
    pos0 = meta_ref[2]
    key_lo = meta_ref[3]
    key_hi = meta_ref[4]
    first_block = key_lo // block_size
    last_block = jnp.minimum(jnp.maximum(key_hi - 1, 0) // block_size, max_blocks - 1)
    n_chunks = jnp.where(key_hi > key_lo, (key_hi - first_block * block_size + chunk - 1) // chunk, 0)
    per_split = (n_chunks + num_kv_splits - 1) // num_kv_splits
    c_lo = split * per_split
    c_hi = jnp.minimum(c_lo + per_split, n_chunks)

    r = jnp.arange(block_m, dtype=jnp.int32)
    row_pos = pos0 + r // group_p
    row_ok = (r // group_p < nrows) & (r % group_p < group)
    q = q_ref[...]
    layer = layer_ref[0] if k_ref.ndim == 5 else None

    def load(ref, blocks):
        if layer is None:
            x = ref[blocks, :, head, :]
        else:
            x = ref[layer, blocks, :, head, :]
        return x.reshape(chunk, head_dim)

    def body(c, carry):
        acc, m, denom = carry
        block_idx = first_block + c * chunk_blocks + jnp.arange(chunk_blocks, dtype=jnp.int32)
        # Past the tile's last needed block, re-read that block (masked below): no table entry
        # or cache block beyond what the sequence needs is ever touched, whatever it holds.
        blocks = tables_ref[seq, jnp.minimum(block_idx, last_block)]
        blocks = jnp.minimum(jnp.maximum(blocks, 0), num_blocks - 1)
        key = (first_block + c * chunk_blocks) * block_size + jnp.arange(chunk, dtype=jnp.int32)
        key_ok = ((key >= key_lo) & (key < key_hi))[:, None]
        k = jnp.where(key_ok, load(k_ref, blocks), 0).astype(q.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        # causality (and the window) bound every row inside [key_lo, key_hi)
        mask = row_ok[:, None] & (key[None, :] <= row_pos[:, None])
        if sliding_window is not None:
            mask &= key[None, :] > row_pos[:, None] - sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=1)
        v = jnp.where(key_ok, load(v_ref, blocks), 0).astype(q.dtype)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, denom

    acc = jnp.zeros((block_m, head_dim), jnp.float32)
    m = jnp.full((block_m,), MASK_VALUE, jnp.float32)
    denom = jnp.zeros((block_m,), jnp.float32)
    acc, m, denom = lax.fori_loop(c_lo, c_hi, body, (acc, m, denom))
    if not write_stats:
        o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        m_ref, l_ref = stat_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tiling of one call: powers of two; `block_q * next_pow2(group) >= 16`."""

    block_q: int
    chunk_blocks: int
    num_kv_splits: int
    num_warps: int
    num_stages: int


def resolve_config(q_shape, cache_shape, tables_shape, **overrides) -> KernelConfig:
    num_tokens, num_q_heads, head_dim = q_shape
    block_size, num_kv_heads = cache_shape[-3], cache_shape[-2]
    max_seqs, max_blocks = tables_shape
    fields = default_config(num_tokens, max_seqs, num_q_heads, num_kv_heads, block_size, max_blocks)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    cfg = KernelConfig(**fields)
    group_p = _next_pow2(num_q_heads // num_kv_heads)
    for name, val in (
        ("block_q", cfg.block_q),
        ("chunk_blocks", cfg.chunk_blocks),
        ("block_size", block_size),
        ("head_dim", head_dim),
    ):
        if val < 1 or val & (val - 1):
            raise ValueError(f"{name}={val} must be a power of two for the Triton kernel")
    if cfg.block_q * group_p < 16 or cfg.chunk_blocks * block_size < 16 or head_dim < 16:
        raise ValueError(
            f"Triton dots need >= 16 rows, keys and head_dim; got block_q*group="
            f"{cfg.block_q * group_p}, chunk keys={cfg.chunk_blocks * block_size}, "
            f"head_dim={head_dim}"
        )
    return cfg


class Prepared(NamedTuple):
    """Kernel inputs built from the ragged batch (host-side contract, backend independent)."""

    meta: Int[Array, "NT 8"]  # per tile: seq, nrows, pos0, key_lo, key_hi, 0, 0, 0
    layer: Int[Array, " 1"]
    block_tables: Int[Array, "S M"]
    q_tiles: Float[Array, "NT Hkv BM D"]  # BM = block_q * next_pow2(group)
    plan: TilePlan


def prepare(
    q,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    num_kv_heads: int,
    cfg: KernelConfig,
    sliding_window: int | None = None,
    layer=None,
) -> Prepared:
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    group_p = _next_pow2(group)
    plan = make_tile_plan(
        cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens, block_q=cfg.block_q, sliding_window=sliding_window
    )
    num_tiles = plan.seq.shape[0]
    zero = jnp.zeros_like(plan.seq)
    meta = jnp.stack([plan.seq, plan.nrows, plan.pos0, plan.key_lo, plan.key_hi, zero, zero, zero], axis=1)
    # Query tiles [NT, Hkv, BQ * Gp, D]: rows of one sequence x the query heads of one KV head.
    rows = jnp.minimum(plan.row0[:, None] + jnp.arange(cfg.block_q, dtype=jnp.int32), num_tokens - 1)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_p != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
    q_tiles = qg[rows].transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, cfg.block_q * group_p, head_dim)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    return Prepared(meta, layer_arr, block_tables.astype(jnp.int32), q_tiles, plan)


def launch(
    prep: Prepared,
    k_cache,
    v_cache,
    *,
    cfg: KernelConfig,
    group: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    write_stats: bool = False,
    interpret: bool = False,
):
    """The pallas_call: grid (tile, kv_head, kv_split). Returns (acc,), or (acc, m, denom) per split with several
    splits or `write_stats` (attention sinks join the denominator in `finish`)."""
    num_tiles, num_kv_heads, block_m, head_dim = prep.q_tiles.shape
    grid = (num_tiles, num_kv_heads, cfg.num_kv_splits)

    def full(x):  # the whole array: the kernel indexes it itself (caches, tables, layer)
        zeros = (0,) * x.ndim
        return pl.BlockSpec(x.shape, lambda t, h, j: zeros)

    in_specs = [
        pl.BlockSpec((None, 8), lambda t, h, j: (t, 0)),
        full(prep.layer),
        full(prep.block_tables),
        pl.BlockSpec((None, None, block_m, head_dim), lambda t, h, j: (t, h, 0, 0)),
        full(k_cache),
        full(v_cache),
    ]
    split_out = cfg.num_kv_splits > 1 or write_stats
    o_dtype = jnp.float32 if split_out else prep.q_tiles.dtype
    out_shape = [jax.ShapeDtypeStruct((cfg.num_kv_splits, num_tiles, num_kv_heads, block_m, head_dim), o_dtype)]
    out_specs = [pl.BlockSpec((None, None, None, block_m, head_dim), lambda t, h, j: (j, t, h, 0, 0))]
    if split_out:
        stat = jax.ShapeDtypeStruct((cfg.num_kv_splits, num_tiles, num_kv_heads, block_m), jnp.float32)
        out_shape += [stat, stat]
        out_specs += [pl.BlockSpec((None, None, None, block_m), lambda t, h, j: (j, t, h, 0))] * 2
    kernel = functools.partial(
        _kernel,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        group=group,
        group_p=_next_pow2(group),
        chunk_blocks=cfg.chunk_blocks,
        num_kv_splits=cfg.num_kv_splits,
        write_stats=split_out,
    )
    params = {}
    if _TritonParams is not None:
        params["compiler_params"] = _TritonParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="ragged_paged_attention",
        **params,
    )(prep.meta, prep.layer, prep.block_tables, prep.q_tiles, k_cache, v_cache)


def finish(outs, plan: TilePlan, *, q_shape, group: int, block_q: int, dtype, sinks=None):
    """Merge KV splits (flash decoding), add `sinks` to the denominators, and scatter tile rows back to
    [T, Hq, D]."""
    num_tokens, num_q_heads, head_dim = q_shape
    group_p = _next_pow2(group)
    if len(outs) == 3:
        acc, m, denom = outs
        m_all = m.max(axis=0)
        w = jnp.exp(m - m_all[None])
        l_all = (denom * w).sum(axis=0)
        if sinks is not None:  # [Hkv, BM]: row r of a tile is query head `r % group_p` of its KV head
            rows = jnp.asarray(sinks, jnp.float32).reshape(-1, group)
            rows = jnp.tile(jnp.pad(rows, ((0, 0), (0, group_p - group))), (1, block_q))
            l_all = l_all + jnp.exp(rows[None] - m_all)
        out = (acc * w[..., None]).sum(axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    else:
        out = outs[0][0]
    num_tiles, num_kv_heads = out.shape[:2]
    out = out.reshape(num_tiles, num_kv_heads, block_q, group_p, head_dim).transpose(0, 2, 1, 3, 4)
    out = out[plan.row_tile, plan.row_slot][:, :, :group].reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(plan.row_real[:, None, None], out, 0).astype(dtype)


def ragged_paged_attention_triton(
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
    interpret: bool | None = None,
    block_q: int | None = None,
    chunk_blocks: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Float[Array, "T Hq D"]:
    """The Pallas Triton kernel behind the public contract (see the module docstring)."""
    q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs = map(
        jnp.asarray, (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    )
    _, _, num_kv_heads, _ = cache_dims(k_cache, layer)
    group = q.shape[1] // num_kv_heads
    cfg = resolve_config(
        q.shape,
        k_cache.shape,
        block_tables.shape,
        block_q=block_q,
        chunk_blocks=chunk_blocks,
        num_kv_splits=num_kv_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    prep = prepare(
        q,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        num_kv_heads=num_kv_heads,
        cfg=cfg,
        sliding_window=sliding_window,
        layer=layer,
    )
    outs = launch(
        prep,
        k_cache,
        v_cache,
        cfg=cfg,
        group=group,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        write_stats=sinks is not None,
        interpret=interpret,
    )
    return finish(outs, prep.plan, q_shape=q.shape, group=group, block_q=cfg.block_q, dtype=q.dtype, sinks=sinks)

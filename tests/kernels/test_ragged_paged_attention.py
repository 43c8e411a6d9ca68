"""Ragged paged attention: both backends against a float64 numpy oracle on hostile batches.

Every batch (see `pallas_kernels/ragged_paged_attention/testing.py`) has NaN in every block
no sequence needs and in every table entry past a sequence's last needed block, large stale
values in the tails of last blocks, NaN padding rows in `q`, and padded sequence entries
past `num_seqs`. Decode, prefill and mixed batches share one bucket shape, so each
(layout, dtype) compiles once, as in serving. The Pallas kernel runs in interpret mode here;
the C++ CPU kernel ("cpu") runs natively.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import ragged_paged_attention
from pallas_kernels.ragged_paged_attention import cpu
from pallas_kernels.ragged_paged_attention.cpu import ragged_paged_attention_cpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.testing import make_batch, reference_f64, relative_error
from pallas_kernels.ragged_paged_attention.triton_gpu import ragged_paged_attention_triton

TOL = {"float32": 2e-4, "bfloat16": 3e-2}
NUM_KV_HEADS = 2
BUCKET = dict(num_tokens=32, max_seqs=8, num_blocks=72)  # shared by every batch kind
MAX_CONTEXT = 120

# (q_lens, kv_lens): context lengths are not multiples of any block size, so last blocks
# have tails; "prefill" has a fresh prompt, a chunked prefill continuing a context and a
# one-token prompt; "mixed" interleaves decode tokens and prefill chunks.
KINDS = {
    "decode": ([1, 1, 1, 1, 1, 1], [37, 1, 120, 64, 9, 100]),
    "prefill": ([13, 9, 1], [13, 58, 1]),
    "mixed": ([1, 11, 1, 6, 1], [77, 11, 3, 47, 119]),
}


def _batch(kind, *, group, block_size, head_dim, dtype, seed=0, **kw):
    q_lens, kv_lens = KINDS[kind]
    return make_batch(
        np.random.default_rng(seed),
        q_lens,
        kv_lens,
        num_q_heads=NUM_KV_HEADS * group,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        block_size=block_size,
        dtype=jnp.dtype(dtype),
        max_blocks=MAX_CONTEXT // block_size + 2,
        **BUCKET,
        **kw,
    )


@functools.cache
def _compiled(backend: str, sm_scale: float, sliding_window=None, soft_cap=None, **kw):
    """One jitted function per backend and static config (jit then caches per shape)."""
    if backend == "reference":
        fn = functools.partial(ragged_paged_attention_reference, **kw)
    elif backend == "cpu":
        fn = functools.partial(ragged_paged_attention_cpu, **kw)
    else:
        fn = functools.partial(ragged_paged_attention_triton, interpret=True, **kw)
    return jax.jit(functools.partial(fn, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap))


def _check(batch, out, dtype, *, sm_scale, sliding_window=None, soft_cap=None):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    n = sum(batch.q_lens)
    assert not np.isnan(out[:n]).any(), "NaN in a real row"
    ref = reference_f64(batch, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    err = relative_error(out, ref, batch.q_lens)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"
    return err


def _run(
    backend,
    kinds,
    *,
    group,
    block_size,
    head_dim,
    dtype,
    sliding_window=None,
    soft_cap=None,
    layer=None,
    num_layers=None,
    q_dtype=None,
    **kw,
):
    sm_scale = head_dim**-0.5
    fn = _compiled(backend, sm_scale, sliding_window, soft_cap, **kw)
    for kind in kinds:
        batch = _batch(
            kind,
            group=group,
            block_size=block_size,
            head_dim=head_dim,
            dtype=dtype,
            sliding_window=sliding_window,
            num_layers=num_layers,
            layer=layer,
        )
        if q_dtype is not None:  # e.g. kv_cache_dtype="bfloat16" under a float32 model
            batch.q = batch.q.astype(q_dtype)
        args = batch.args()
        out = fn(*args) if layer is None else fn(*args, layer=jnp.int32(layer))
        _check(batch, out, dtype, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


# --- the reference and the C++ CPU kernel: the full cross product ---------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_cross_product(backend, group, block_size, head_dim, dtype):
    _run(backend, KINDS, group=group, block_size=block_size, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize(
    "kw",
    [
        dict(chunk_tokens=8, items_per_step=1),  # one block per item, one item per step: many merges
        dict(chunk_tokens=32, items_per_step=3, block_q=4),  # items of one tile split across steps
        dict(chunk_tokens=256, block_q=32),  # whole context in one item, tiles wider than sequences
    ],
)
def test_reference_tilings(kw):
    _run("reference", KINDS, group=3, block_size=8, head_dim=64, dtype="float32", **kw)


# --- a bfloat16 cache under float32 queries ------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("group,block_size,head_dim", [(3, 16, 64), (1, 8, 128), (4, 32, 64)])
def test_bfloat16_cache_float32_queries(backend, group, block_size, head_dim):
    """kv_cache_dtype="bfloat16" with a float32 model: half the bytes read, float32 math."""
    _run(backend, KINDS, group=group, block_size=block_size, head_dim=head_dim, dtype="bfloat16", q_dtype=np.float32)


# --- the C++ CPU kernel's decode path: rows split over threads, and its fallbacks ----------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (1900, 30.0)])
def test_cpu_decode_rows_split_into_slices(dtype, sliding_window, soft_cap):
    """Decode rows long enough to be split into slices (flash-decoding, on >= 2 threads: more than the
    kernel's kMinTeamCost of 4096 keys in all) beside short ones; slices start mid-block under the window,
    and the last block has a tail."""
    batch = make_batch(
        np.random.default_rng(1),
        [1] * 6,
        [2900, 37, 1, 1333, 603, 2500],
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=jnp.dtype(dtype),
        sliding_window=sliding_window,
    )
    out = _compiled("cpu", 64**-0.5, sliding_window, soft_cap)(*batch.args())
    _check(batch, out, dtype, sm_scale=64**-0.5, sliding_window=sliding_window, soft_cap=soft_cap)


# --- attention sinks (gpt-oss): a logit per query head in each row's denominator ---------------


@pytest.mark.parametrize(
    "backend,cfg",
    [
        ("reference", {}),
        ("cpu", {}),  # decode rows (one unit, merged) and prefill tiles
        ("pallas", {}),
        ("pallas", dict(num_kv_splits=2, block_q=4)),  # the sinks join the merged splits
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_attention_sinks(backend, cfg, sliding_window):
    """Sinks large and small against the scores (some rows give most of their weight to the sink), with and
    without a window whose outside blocks are NaN, every batch kind, GQA 3."""
    group, head_dim = 3, 64
    sinks = np.random.default_rng(5).normal(0.0, 2.0, NUM_KV_HEADS * group).astype(np.float32)
    sm_scale = head_dim**-0.5
    fn = _compiled(backend, sm_scale, sliding_window, None, **cfg)
    for kind in KINDS:
        batch = _batch(
            kind, group=group, block_size=8, head_dim=head_dim, dtype="float32", sliding_window=sliding_window
        )
        out = np.asarray(fn(*batch.args(), sinks=jnp.asarray(sinks)))
        ref = reference_f64(batch, sm_scale=sm_scale, sliding_window=sliding_window, sinks=sinks)
        assert not np.isnan(out[: sum(batch.q_lens)]).any()
        assert relative_error(out, ref, batch.q_lens) <= TOL["float32"]
        plain = reference_f64(batch, sm_scale=sm_scale, sliding_window=sliding_window)
        assert relative_error(plain, ref, batch.q_lens) > 0.05  # the sinks matter


def test_cpu_decode_slices_merge_with_sinks():
    """Long decode rows split over threads: the sinks join once, after the slices merge."""
    batch = make_batch(
        np.random.default_rng(2),
        [1] * 4,
        [2900, 37, 1333, 2500],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=jnp.dtype("float32"),
    )
    sinks = np.linspace(-3.0, 6.0, 6).astype(np.float32)
    out = _compiled("cpu", 64**-0.5)(*batch.args(), sinks=jnp.asarray(sinks))
    ref = reference_f64(batch, sm_scale=64**-0.5, sinks=sinks)
    assert relative_error(out, ref, batch.q_lens) <= TOL["float32"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("context,q_len", [(157, 157), (300, 64), (40, 13)])
def test_cpu_a_chunks_rows_score_as_they_do_alone(dtype, context, q_len):
    """A prefill chunk's rows go several to a unit (`attend_rows`); each row's output is bit for bit the one it gets
    as a one-row sequence over the same blocks (a step verifying drafts then scores its rows as one-row steps do,
    and greedy speculation keeps the text)."""
    rng = np.random.default_rng(5)
    block_size, kv_heads, group, head_dim, num_blocks = 16, 3, 3, 64, 24
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(2))
    table = rng.permutation(num_blocks).astype(np.int32)[: -(-context // block_size)]
    q = jnp.asarray(rng.standard_normal((q_len, kv_heads * group, head_dim), np.float32))
    chunk = ragged_paged_attention_cpu(q, k, v, [context], table[None], [0, q_len], 1, sm_scale=0.125)
    alone = ragged_paged_attention_cpu(
        q,
        k,
        v,
        np.arange(context - q_len + 1, context + 1),
        np.tile(table, (q_len, 1)),
        np.arange(q_len + 1),
        q_len,
        sm_scale=0.125,
    )
    assert np.array_equal(np.asarray(chunk), np.asarray(alone))


@pytest.mark.parametrize("group,head_dim", [(2, 40), (12, 64)])
def test_cpu_decode_fallback_layouts(group, head_dim):
    """Head dims that are not a multiple of 16 and groups wider than 8 take the row-tile path."""
    _run("cpu", ["decode", "mixed"], group=group, block_size=16, head_dim=head_dim, dtype="float32")


# --- the Pallas kernel (interpret mode): a covering subset --------------------------------

PALLAS_CONFIGS = [  # every GQA ratio, block size, head dim and dtype appears; all kinds run
    dict(group=1, block_size=8, head_dim=64, dtype="float32"),
    dict(group=3, block_size=16, head_dim=128, dtype="bfloat16"),
    dict(group=4, block_size=32, head_dim=64, dtype="float32"),
    dict(group=4, block_size=16, head_dim=128, dtype="bfloat16"),
    dict(group=3, block_size=8, head_dim=64, dtype="float32", num_kv_splits=2, block_q=4),
    dict(group=1, block_size=32, head_dim=128, dtype="bfloat16", num_kv_splits=4),
]


@pytest.mark.parametrize("cfg", PALLAS_CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_pallas(cfg):
    _run("pallas", KINDS, **cfg)


@pytest.mark.parametrize("backend", ["reference", "pallas", "cpu"])
def test_table_entries_past_the_context_are_never_followed(backend):
    """Entries past a sequence's last needed block may hold anything, even invalid ids."""
    block_size, head_dim = 16, 64
    batch = _batch("mixed", group=4, block_size=block_size, head_dim=head_dim, dtype="float32")
    garbage = np.where(np.arange(batch.block_tables.shape[1]) % 2, -7, 10**6).astype(np.int32)
    for i in range(batch.block_tables.shape[0]):
        used = -(-int(batch.kv_lens[i]) // block_size) if i < len(batch.q_lens) else 0
        batch.block_tables[i, used:] = garbage[used:]
    out = _compiled(backend, head_dim**-0.5)(*batch.args())
    _check(batch, out, "float32", sm_scale=head_dim**-0.5)


# --- sliding window, soft cap, the layer-stacked cache ------------------------------------


@pytest.mark.parametrize("backend", ["reference", "pallas", "cpu"])
@pytest.mark.parametrize("sliding_window,soft_cap", [(24, None), (None, 20.0), (9, 5.0)])
def test_window_and_soft_cap(backend, sliding_window, soft_cap):
    # the batch builder also points table entries wholly before each window at NaN blocks
    _run(
        backend,
        ["mixed", "prefill"],
        group=4,
        block_size=8,
        head_dim=64,
        dtype="float32",
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )


@pytest.mark.parametrize("backend", ["reference", "pallas", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_stacked_cache(backend, dtype):
    for layer in (0, 2):
        _run(backend, ["mixed"], group=3, block_size=16, head_dim=64, dtype=dtype, num_layers=3, layer=layer)


@pytest.mark.parametrize("backend", ["reference", "pallas", "cpu"])
def test_layer_stacked_cache_in_scan(backend):
    """The model's pattern: scan over layers with the whole 5-D cache as carry, traced layer."""
    num_layers, head_dim = 3, 64
    batch = _batch("mixed", group=4, block_size=16, head_dim=head_dim, dtype="float32", num_layers=num_layers, layer=0)
    q, k_cache, v_cache, *meta = batch.args()

    @jax.jit
    def run(q, k_cache, v_cache, *meta):
        def step(carry, layer):
            k, v = carry
            out = ragged_paged_attention(q, k, v, *meta, sm_scale=head_dim**-0.5, layer=layer, backend=backend)
            return (k, v), out

        _, outs = jax.lax.scan(step, (k_cache, v_cache), jnp.arange(num_layers, dtype=jnp.int32))
        return outs

    outs = run(q, k_cache, v_cache, *meta)
    for layer in range(num_layers):
        batch.layer = layer
        _check(batch, outs[layer], "float32", sm_scale=head_dim**-0.5)


def test_pallas_lowers_stacked_cache_without_copy():
    """In HLO the kernel takes the whole 5-D cache: no per-layer slice is materialised."""
    f = jax.jit(
        lambda q, k, v, *m, layer: ragged_paged_attention_triton(
            q, k, v, *m, layer=layer, sm_scale=0.1, interpret=False
        )
    )
    args = _shapes(five=True)
    text = f.trace(*args, layer=jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "xla.gpu.triton" in line)
    assert call.count("tensor<3x64x16x2x64xbf16>") == 2, "K and V must reach the kernel as the full 5-D cache"


# --- compiled for CUDA, on this CPU-only machine -----------------------------------------


def _shapes(five: bool, dtype=jnp.bfloat16, num_tokens=32, max_seqs=8, head_dim=64, group=4):
    sds = jax.ShapeDtypeStruct
    cache = (3, 64, 16, NUM_KV_HEADS, head_dim) if five else (64, 16, NUM_KV_HEADS, head_dim)
    return (
        sds((num_tokens, NUM_KV_HEADS * group, head_dim), dtype),
        sds(cache, dtype),
        sds(cache, dtype),
        sds((max_seqs,), jnp.int32),
        sds((max_seqs, 16), jnp.int32),
        sds((max_seqs + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(five=False),
        dict(five=True),
        dict(five=False, dtype=jnp.float32, num_tokens=8, group=3, num_kv_splits=4, sliding_window=32, soft_cap=30.0),
        dict(five=True, num_tokens=256, head_dim=128, group=1),
    ],
)
def test_lowers_for_cuda(kw):
    kw = dict(kw)
    static = {k: kw.pop(k) for k in ("num_kv_splits", "sliding_window", "soft_cap") if k in kw}
    five = kw["five"]

    def f(*a):
        layer = jnp.int32(2) if five else None
        return ragged_paged_attention_triton(*a, sm_scale=0.125, layer=layer, interpret=False, **static)

    lowered = jax.jit(f).trace(*_shapes(**kw)).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


# --- contract, dispatch, compilation ------------------------------------------------------


def test_dispatch_and_errors():
    batch = _batch("mixed", group=1, block_size=16, head_dim=64, dtype="float32")
    assert jax.default_backend() == "cpu"
    assert cpu.available(), "the C++ kernel must build here (a C++ compiler is a test requirement)"
    auto = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125))
    for kind in ("decode", "mixed", "prefill"):  # "auto" on CPU: the C++ kernel for every batch
        b = _batch(kind, group=1, block_size=16, head_dim=64, dtype="float32")
        chosen = ragged_paged_attention(*b.args(), sm_scale=0.125, backend="cpu")
        np.testing.assert_array_equal(np.asarray(auto(*b.args())), np.asarray(chosen), err_msg=kind)
        _check(b, chosen, "float32", sm_scale=0.125)
    f16 = [a.astype(np.float16) if a.dtype == np.float32 else a for a in batch.args()]
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ragged_paged_attention(*f16, sm_scale=0.125, backend="cpu")
    fallback = ragged_paged_attention(*f16, sm_scale=0.125)  # "auto" falls back to the reference
    assert not np.isnan(np.asarray(fallback, np.float32)[: sum(batch.q_lens)]).any()
    with pytest.raises(ValueError, match="backend"):
        ragged_paged_attention(*batch.args(), sm_scale=0.125, backend="cuda")
    q, k, v, *meta = batch.args()
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention(q[..., :32], k, v, *meta, sm_scale=0.125)
    with pytest.raises(ValueError, match="layer"):
        ragged_paged_attention(q, k[None], v[None], *meta, sm_scale=0.125)
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(q, k, v, meta[0], meta[1], meta[2][:-1], meta[3], sm_scale=0.125)


def test_one_compilation_serves_every_context_length():
    fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.125))
    for seed, kind in enumerate(KINDS):
        batch = _batch(kind, group=3, block_size=16, head_dim=64, dtype="float32", seed=seed)
        _check(batch, fn(*batch.args()), "float32", sm_scale=0.125)
    if hasattr(fn, "_cache_size"):  # private, but the only direct compile count
        assert fn._cache_size() == 1


# --- write_kv ------------------------------------------------------------------------------


def _cache(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layer", [None, 1])
def test_write_kv_scatters_by_slot(layer, dtype, backend):
    num_blocks, block_size, hkv, d = 12, 8, 2, 16
    shape = (num_blocks, block_size, hkv, d) if layer is None else (3, num_blocks, block_size, hkv, d)
    k_cache, v_cache = (np.asarray(jnp.asarray(_cache(shape, i), dtype)) for i in (0, 1))
    rng = np.random.default_rng(2)
    real = rng.choice(np.arange(block_size, num_blocks * block_size), size=9, replace=False)  # block 0: scratch
    slots = np.concatenate([real, [0, 0, 0]]).astype(np.int32)  # three padding rows -> scratch slot
    k_new = rng.standard_normal((len(slots), hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((len(slots), hkv, d)).astype(np.float32)
    k_new[0, 0, :3] = [np.nan, np.inf, 1 + 2**-8]  # NaN, inf and a bfloat16 rounding tie survive the cast
    lay = None if layer is None else jnp.int32(layer)
    write = functools.partial(pallas_kernels.write_kv, backend=backend)
    k_out, v_out = jax.jit(write)(k_cache, v_cache, k_new, v_new, slots, lay)
    k_exp, v_exp = k_cache.copy(), v_cache.copy()
    for i, s in enumerate(real):  # the cast as jnp's astype does it (round to nearest even)
        idx = (s // block_size, s % block_size) if layer is None else (layer, s // block_size, s % block_size)
        k_exp[idx], v_exp[idx] = (np.asarray(jnp.asarray(x[i]).astype(dtype)) for x in (k_new, v_new))
    keep = np.ones(shape[:-2], bool)  # everything but the scratch slot must match exactly
    keep[(..., 0, 0) if layer is None else (layer, 0, 0)] = False
    np.testing.assert_array_equal(np.asarray(k_out)[keep], k_exp[keep])
    np.testing.assert_array_equal(np.asarray(v_out)[keep], v_exp[keep])


@pytest.mark.parametrize("layer", [None, 1])
def test_write_kv_on_donated_cache_does_not_copy(layer):
    shape = (256, 16, 2, 64) if layer is None else (3, 256, 16, 2, 64)  # 1-3 MiB per cache
    k_cache = jnp.asarray(_cache(shape, 0))
    v_cache = jnp.asarray(_cache(shape, 1))
    t = 8
    new = jnp.ones((t, 2, 64), jnp.float32)
    slots = jnp.arange(16, 16 + t, dtype=jnp.int32)
    lay = None if layer is None else jnp.int32(layer)
    step = jax.jit(pallas_kernels.write_kv, donate_argnums=(0, 1))
    compiled = step.lower(k_cache, v_cache, new, new, slots, lay).compile()
    hlo = compiled.as_text()
    assert "input_output_alias" in hlo, "the caches must alias the outputs"
    cache_bytes = k_cache.size * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < cache_bytes // 8, f"{temp} temporary bytes: the step copies a cache of {cache_bytes}"
    k_in_ptr = k_cache.unsafe_buffer_pointer()
    k_out, _ = step(k_cache, v_cache, new, new, slots, lay)
    assert k_cache.is_deleted() and v_cache.is_deleted()
    assert k_out.unsafe_buffer_pointer() == k_in_ptr, "the updated cache must reuse the donated buffer"


def test_layer_scan_with_write_and_attention_does_not_copy_the_cache():
    """The model's step: scan over layers, cache as carry, write_kv then attention, donated."""
    num_layers, num_blocks, block_size, hkv, d, t = 4, 1024, 16, 2, 64, 16
    shape = (num_layers, num_blocks, block_size, hkv, d)  # 32 MiB per cache, 8 MiB per layer
    k_cache = jnp.zeros(shape, jnp.float32)
    v_cache = jnp.zeros(shape, jnp.float32)
    q = jnp.ones((t, hkv * 4, d), jnp.float32)
    new = jnp.ones((t, hkv, d), jnp.float32)
    slots = jnp.arange(16, 16 + t, dtype=jnp.int32)
    kv_lens = jnp.full((8,), 2, jnp.int32).at[0].set(20)
    tables = jnp.ones((8, 4), jnp.int32)
    cu = jnp.asarray([0, 10, 11, 12, 13, 14, 15, 16, 16], jnp.int32)
    num_seqs = jnp.asarray([7], jnp.int32)

    def step(k_cache, v_cache):
        def layer_fn(carry, layer):
            k, v = pallas_kernels.write_kv(*carry, new, new, slots, layer)
            out = ragged_paged_attention(q, k, v, kv_lens, tables, cu, num_seqs, sm_scale=0.125, layer=layer)
            return (k, v), out.sum()

        (k, v), outs = jax.lax.scan(layer_fn, (k_cache, v_cache), jnp.arange(num_layers, dtype=jnp.int32))
        return k, v, outs

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(k_cache, v_cache).compile()
    layer_bytes = k_cache.nbytes // num_layers
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < layer_bytes // 2, f"{temp} temporary bytes: a layer ({layer_bytes}) or the cache is copied"

"""The fused LoRA kernel (`pallas_kernels.stacked_matmul.lora.add_lora`) and the XLA path it replaces on CPU
(`jaxllm.model.lora.lora_delta`), against a float64 oracle on random ragged batches of slots: every token's
`(x @ A[slot]) @ B[slot]` added to y, slot-0 tokens untouched. The slots no token names, slot 0 and the other layers
are NaN-poisoned (a read of them fails), and so are the rows of x of slot-0 tokens (a kernel that multiplied them
would leak NaN into their outputs)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model.lora import lora_delta, tile_tokens
from pallas_kernels.stacked_matmul import lora

LAYERS, SLOTS, LAYER, RANK = 3, 5, 1, 6  # RANK 6: rank widths 18, 12, 6 leave remainders of every tile
# (K, the fused output's shape, its parts' extents along parts_axis, parts_axis): q/k/v interleaved per KV head,
# gate/up side by side, one part
PROJECTIONS = (
    (64, (2, 4, 32), (2, 1, 1), 1),
    (96, (2, 160), (1, 1), 0),
    (128, (48,), (1,), None),
)
TOKENS = (1, 3, 4, 5, 9, 64)


def parts_of(out: tuple[int, ...], extents: tuple[int, ...], axis: int | None) -> list[tuple[int, ...]]:
    if axis is None:
        return [out]
    return [(*out[:axis], e, *out[axis + 1 :]) for e in extents]


def case(seed: int, tokens: int, k: int, out, extents, axis):
    rng = np.random.default_rng(seed)
    parts = parts_of(out, extents, axis)
    a = rng.standard_normal((LAYERS, SLOTS, len(parts) * RANK, k)).astype(np.float32)
    bs = [rng.standard_normal((LAYERS, SLOTS, RANK, *p)).astype(np.float32) for p in parts]
    slots = rng.integers(0, SLOTS - 1, tokens).astype(np.int32)  # the last slot never named
    slots[0] = 1  # at least one adapter token
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    y = rng.standard_normal((tokens, *out)).astype(np.float32)
    for w in (a, *bs):  # every slot a token does not name, slot 0 and every other layer: NaN
        named = np.zeros(w.shape[:2], bool)
        named[LAYER, np.unique(slots[slots > 0])] = True
        w[~named] = np.nan
    x[slots == 0] = np.nan
    return x, y, a, bs, slots


def oracle(x, y, a, bs, slots, axis):
    want = y.astype(np.float64).copy()
    for t, s in enumerate(slots):
        if s == 0:
            continue
        h = a[LAYER, s].astype(np.float64) @ x[t].astype(np.float64)
        deltas = [
            np.tensordot(h[p * RANK : (p + 1) * RANK], b[LAYER, s].astype(np.float64), 1) for p, b in enumerate(bs)
        ]
        want[t] += deltas[0] if axis is None else np.concatenate(deltas, axis=axis)
    return want


def check(got, want, x, a, bs, slots):
    """Within float32 accumulation of the oracle on the adapter tokens; slot-0 tokens exactly y."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    zero = slots == 0
    np.testing.assert_array_equal(got[zero], want[zero])
    scale = max(1.0, math.sqrt(x.shape[1] * a.shape[2]) * RANK)
    np.testing.assert_allclose(got[~zero], want[~zero], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.skipif(not lora.available(), reason="the CPU kernel did not build")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("projection", PROJECTIONS, ids=["qkv", "gate_up", "one_part"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_kernel_matches_the_float64_oracle(tokens, projection, dtype):
    k, out, extents, axis = projection
    x, y, a, bs, slots = case(tokens * 7 + k, tokens, k, out, extents, axis)
    wa, wbs = jnp.asarray(a, dtype), [jnp.asarray(b, dtype) for b in bs]  # the oracle on the rounded weights
    a, bs = np.asarray(wa, np.float64), [np.asarray(b, np.float64) for b in wbs]
    assert lora.applies(wa, wbs, axis)
    got = lora.add_lora(jnp.asarray(y), jnp.asarray(x), wa, wbs, jnp.asarray(slots), LAYER, axis)
    check(got, oracle(x, y, a, bs, slots, axis), x, a, bs, slots)


@pytest.mark.parametrize("projection", PROJECTIONS[:2], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("tokens", (1, 9))
def test_xla_path_matches_the_float64_oracle(tokens, projection):
    """The tiled path (GPU, tensor parallelism) on the same layouts; it multiplies slot 0's zeros, so no poison
    there."""
    k, out, extents, axis = projection
    x, y, a, bs, slots = case(tokens + k, tokens, k, out, extents, axis)
    for w in (a, *bs):
        w[:, 0] = 0
    x[slots == 0] = 1.0
    tiles = tile_tokens(slots, SLOTS)
    delta = lora_delta(
        jnp.asarray(x), jnp.asarray(a), [jnp.asarray(b) for b in bs], type(tiles)(*map(jnp.asarray, tiles)), LAYER, axis
    )
    check(jnp.asarray(y) + delta, oracle(x, y, a, bs, slots, axis), x, a, bs, slots)


def test_kernel_declines_shapes_out_of_whole_vectors():
    a = np.zeros((1, 2, 8, 72), np.float32)  # K 72: not whole 16-lane vectors
    assert not lora.applies(a, [np.zeros((1, 2, 8, 64), np.float32)], None)
    assert not lora.applies(np.zeros((1, 2, 8, 64), np.float32), [np.zeros((1, 2, 8, 40), np.float32)], None)

"""`x @ w[layer]` on a layer stack: the C++ CPU kernel and the reference against a float64 oracle.

Every layer but the one picked is NaN, so a kernel that read outside its layer fails loudly;
shapes are odd (K and N not multiples of a vector or a thread's share) and the layer index is
traced, as in the scanned model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import stacked_matmul
from pallas_kernels.stacked_matmul import stacked_matmul_cpu, stacked_matmul_reference


def poisoned_stack(rng, layers, k, out_shape, layer):
    w = np.full((layers, k, *out_shape), np.nan, np.float32)
    w[layer] = rng.normal(0, 0.05, (k, *out_shape)).astype(np.float32)
    return w


# rows 1-4 stream the weights; more multiply packed 32-column panels in 8-row tiles: cover both,
# a last panel narrower than 32 columns (257, 105) and a last tile shorter than 8 rows (13, 37)
@pytest.mark.parametrize(
    "rows,k,out_shape",
    [
        (1, 576, (960,)),
        (3, 200, (3, 5, 7)),
        (8, 131, (2, 257)),
        (2, 1536, (576,)),
        (13, 64, (105,)),
        (37, 576, (3, 2, 64)),
        (64, 100, (96,)),
    ],
)
def test_kernel_matches_the_oracle_and_reads_only_its_layer(rows, k, out_shape):
    assert stacked_matmul.available(), "the C++ kernel must build here (a C++ compiler is a test requirement)"
    rng = np.random.default_rng(rows * 1000 + k)
    layers, layer = 5, int(rng.integers(0, 5))
    w = poisoned_stack(rng, layers, k, out_shape, layer)
    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    want = np.tensordot(x.astype(np.float64), w[layer].astype(np.float64), axes=(1, 0))
    for fn in (stacked_matmul_cpu, stacked_matmul_reference):
        got = np.asarray(jax.jit(fn)(x, w, jnp.int32(layer)))
        assert got.shape == (rows, *out_shape)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


# "cpu_packed": whole panels only (N a multiple of 32); every row count multiplies the packed panels.
# bfloat16 (x and w, K even): the oracle multiplies the same bfloat16 values in float64, so only the
# float32 accumulation may differ
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "rows,k,out_shape",
    [(1, 576, (960,)), (3, 200, (2, 32)), (8, 132, (64,)), (13, 1536, (576,)), (37, 64, (3, 2, 64)), (64, 100, (96,))],
)
def test_packed_kernel_matches_the_oracle_and_reads_only_its_layer(rows, k, out_shape, dtype):
    rng = np.random.default_rng(rows * 1000 + k)
    layers, layer = 5, int(rng.integers(0, 5))
    w = poisoned_stack(rng, layers, k, out_shape, layer).astype(dtype)
    x = rng.normal(0, 1, (rows, k)).astype(dtype)
    want = np.tensordot(x.astype(np.float64), w[layer].astype(np.float64), axes=(1, 0))
    assert stacked_matmul.packable(w)
    packed = stacked_matmul.pack(w)
    assert packed.shape == w.shape and packed.dtype == w.dtype
    assert not np.array_equal(packed.astype(np.float32), w.astype(np.float32), equal_nan=True)
    np.testing.assert_array_equal(np.asarray(stacked_matmul.pack(jnp.asarray(w))), packed)  # device arrays alike
    got = np.asarray(jax.jit(lambda x, w, i: stacked_matmul_cpu(x, w, i, packed=True))(x, packed, jnp.int32(layer)))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    fn = jax.jit(lambda x, w, i: stacked_matmul.stacked_matmul(x, w, i, backend="cpu_packed"))
    got = np.asarray(fn(x, packed, jnp.int32(layer)))  # the model's entry: the result in the weights' dtype
    assert got.dtype == w.dtype
    rounding = 2e-4 if dtype == "float32" else 2**-8  # bfloat16 keeps 8 significant bits
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rounding, atol=2e-5)


# a mixture of experts' grouped matmul: tiles of rows, each against its own expert (a layer of the stack);
# padding rows of a tile are NaN (they must not leak into other rows) and so is every expert no tile names
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tile_rows", [1, 3, 8, 17])
def test_grouped_kernel_runs_each_tile_against_its_own_layer(tile_rows, dtype):
    rng = np.random.default_rng(tile_rows)
    layers, k, out_shape, num_tiles = 6, 132, (2, 32), 5
    index = np.array([4, 1, 1, 3, 4], np.int32)  # a layer twice in a row and twice apart; 0, 2, 5 unused
    w = np.full((layers, k, *out_shape), np.nan, np.float32)
    for layer in set(index.tolist()):
        w[layer] = rng.normal(0, 0.05, (k, *out_shape))
    w = w.astype(dtype)
    tiles = rng.normal(0, 1, (num_tiles, tile_rows, k)).astype(dtype)
    pad = rng.random((num_tiles, tile_rows)) < 0.3
    pad[:, 0] = False
    tiles[pad] = np.nan
    want = np.einsum("smk,skn->smn", tiles.astype(np.float64), w[index].astype(np.float64).reshape(num_tiles, k, -1))
    packed = jnp.asarray(stacked_matmul.pack(w))
    for max_rows in (None, tile_rows - 1):  # the one kernel call; XLA tile by tile above kernel_max_rows
        fn = jax.jit(lambda t, w, i, m=max_rows: stacked_matmul.grouped_matmul(t, w, i, kernel_max_rows=m))
        got = np.asarray(fn(tiles, packed, index)).astype(np.float64)
        assert got.shape == (num_tiles, tile_rows, *out_shape) and got.dtype == np.float64
        rounding = 2e-4 if dtype == "float32" else 2**-8
        np.testing.assert_allclose(got[~pad].reshape(-1, 64), want[~pad], rtol=rounding, atol=2e-5)


def test_bfloat16_needs_packed_weights_and_an_even_k():
    w = np.ones((2, 33, 32), "bfloat16")
    assert not stacked_matmul.packable(w)  # K odd: no pairs
    with pytest.raises(ValueError, match="bfloat16"):
        stacked_matmul_cpu(jnp.ones((4, 34), jnp.bfloat16), jnp.ones((2, 34, 32), jnp.bfloat16), 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("transposed", [False, True])  # an lm_head kernel [K, N]; a tied embedding [N, K]
def test_packed_single_matrix_matches_the_oracle(transposed, dtype):
    rng = np.random.default_rng(11)
    k, n = 72, 4 * 32
    w = rng.normal(0, 0.05, (k, n)).astype(dtype)
    stored = w.T.copy() if transposed else w
    packed = stacked_matmul.pack_matrix(stored, transposed=transposed)
    assert packed.shape == stored.shape
    for rows in (1, 9, 64):
        x = rng.normal(0, 1, (rows, k)).astype(dtype)
        got = np.asarray(jax.jit(stacked_matmul.packed_matmul)(x, jnp.asarray(packed)))
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=2e-4, atol=2e-5)
    if transposed:  # the embedding lookup reads the same packed array
        index = jnp.asarray([0, 5, 31, 32, 127, 64, 5], jnp.int32)
        np.testing.assert_array_equal(np.asarray(jax.jit(stacked_matmul.packed_rows)(packed, index)), stored[index])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_above_kernel_max_rows_xla_reads_the_packed_weights(dtype):
    """Where the self-check found XLA faster, "cpu_packed" multiplies the packed layout with XLA's dot:
    same values, no kernel call, no unpacked copy."""
    rng = np.random.default_rng(5)
    layers, layer, k, out_shape = 3, 2, 132, (2, 64)
    w = poisoned_stack(rng, layers, k, out_shape, layer).astype(dtype)
    packed = jnp.asarray(stacked_matmul.pack(w))
    for rows in (3, 9, 40):
        x = rng.normal(0, 1, (rows, k)).astype(dtype)
        want = np.tensordot(x.astype(np.float64), w[layer].astype(np.float64), axes=(1, 0))
        fn = jax.jit(lambda x, w, i: stacked_matmul.stacked_matmul(x, w, i, backend="cpu_packed", kernel_max_rows=8))
        assert ("jaxllm_stacked_matmul_cpu" in fn.lower(x, packed, jnp.int32(layer)).as_text()) == (rows <= 8)
        got = np.asarray(fn(x, packed, jnp.int32(layer)))
        rounding = 2e-4 if dtype == "float32" else 2**-8
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=rounding, atol=2e-5)
    head = stacked_matmul.pack_matrix(w[layer].reshape(k, -1))
    x = rng.normal(0, 1, (12, k)).astype(dtype)
    got = np.asarray(jax.jit(lambda x, w: stacked_matmul.packed_matmul(x, w, kernel_max_rows=4))(x, head))
    want = x.astype(np.float64) @ w[layer].reshape(k, -1).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_packed_backend_leaves_unpackable_weights_to_the_plain_kernel():
    rng = np.random.default_rng(7)
    w = poisoned_stack(rng, 3, 40, (2, 257), 1)  # N = 514: not whole panels, so never packed
    x = rng.normal(0, 1, (5, 40)).astype(np.float32)
    assert not stacked_matmul.packable(w)
    got = stacked_matmul.stacked_matmul(x, w, 1, backend="cpu_packed")
    np.testing.assert_allclose(np.asarray(got), np.tensordot(x, w[1], axes=(1, 0)), rtol=2e-4, atol=2e-5)


def test_auto_picks_the_kernel_for_float32_and_the_reference_otherwise():
    w = jnp.ones((2, 64, 8), jnp.float32)
    hlo = lambda x, w: jax.jit(lambda x, w: stacked_matmul.stacked_matmul(x, w, 1)).lower(x, w).as_text()  # noqa: E731
    for rows in (1, 512):
        assert "jaxllm_stacked_matmul_cpu" in hlo(jnp.ones((rows, 64), jnp.float32), w)
    assert "jaxllm_stacked_matmul_cpu" not in hlo(jnp.ones((4, 64), jnp.bfloat16), w.astype(jnp.bfloat16))


def test_inside_a_scan_over_layers():
    rng = np.random.default_rng(7)
    w = rng.normal(0, 0.05, (4, 48, 48)).astype(np.float32)
    x = rng.normal(0, 1, (2, 48)).astype(np.float32)

    def run(fn):
        def body(h, layer):
            return jnp.tanh(fn(h, w, layer)), None

        return jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(4))[0])(x)

    want = x.astype(np.float64)
    for layer in range(4):
        want = np.tanh(want @ w[layer])
    for fn in (stacked_matmul_cpu, stacked_matmul_reference):
        np.testing.assert_allclose(np.asarray(run(fn)), want, rtol=1e-4, atol=1e-5)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="backend"):
        stacked_matmul.stacked_matmul(jnp.ones((1, 4)), jnp.ones((2, 4, 4)), 0, backend="fast")
    with pytest.raises(ValueError, match="float32"):
        stacked_matmul_cpu(jnp.ones((1, 4), jnp.bfloat16), jnp.ones((2, 4, 4), jnp.bfloat16), 0)

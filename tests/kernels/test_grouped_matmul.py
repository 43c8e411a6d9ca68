"""The Pallas grouped matmul (`pallas_kernels.grouped_matmul`, a mixture of experts' tiles against their own
experts on GPUs): in interpret mode against a float64 oracle, every expert no tile names NaN and the padding
rows of each tile NaN, so reading either shows; and lowered for CUDA (Triton) on this CPU-only machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm

INDEX = np.array([4, 1, 1, 3, 4], np.int32)  # an expert twice in a row and twice apart; 0, 2 and 5 unused


def experts(rng, k: int, out_shape: tuple[int, ...], dtype) -> np.ndarray:
    w = np.full((6, k, *out_shape), np.nan, np.float32)
    for e in set(INDEX.tolist()):
        w[e] = rng.normal(0, 0.05, (k, *out_shape))
    return w.astype(dtype)


# rows: a decode tile (1), a few (5, padded to 16 for Triton's dot), more than one block (17);
# K and N: one block, several, and 768 (Qwen3-30B-A3B's expert width: 256-wide K blocks)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,k,out_shape", [(1, 64, (2, 32)), (5, 96, (64,)), (17, 768, (128,))])
def test_each_tile_times_its_expert_matches_the_oracle(rows, k, out_shape, dtype):
    rng = np.random.default_rng(rows)
    w = experts(rng, k, out_shape, dtype)
    tiles = rng.normal(0, 1, (len(INDEX), rows, k)).astype(dtype)
    pad = rng.random((len(INDEX), rows)) < 0.3
    pad[:, 0] = False
    tiles[pad] = np.nan
    assert gm.supports(w)
    got = np.asarray(jax.jit(gm.grouped_matmul)(tiles, w, INDEX), np.float64)
    assert got.shape == (len(INDEX), rows, *out_shape)
    flat = w[INDEX].astype(np.float64).reshape(len(INDEX), k, -1)
    want = np.einsum("smk,skn->smn", tiles.astype(np.float64), flat)
    got = got.reshape(want.shape)
    assert np.isfinite(got[~pad]).all(), "a padding row or an unused expert leaked into a result"
    np.testing.assert_allclose(got[~pad], want[~pad], rtol=1e-4, atol=1e-5 if dtype == "float32" else 2e-3)


def test_shapes_the_blocks_cannot_tile_are_refused():
    assert not gm.supports(np.zeros((2, 24, 64), np.float32))  # K below a 16-wide block
    assert not gm.supports(np.zeros((2, 64, 40), np.float32))  # N not whole 16-wide blocks
    assert not gm.supports(np.zeros((2, 64, 64), np.int8))  # quantized experts: XLA's path


def test_lowers_for_cuda():
    """The full Pallas-to-Triton lowering of an OLMoE-sized layer's experts (64 x [2048, 2 x 1024], bfloat16)."""
    assert gm._TritonParams is not None, "this JAX has no Pallas Triton backend"
    shapes = (
        jax.ShapeDtypeStruct((8, 1, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, 2048, 2, 1024), jnp.bfloat16),
        jax.ShapeDtypeStruct((8,), jnp.int32),
    )
    fn = jax.jit(lambda x, w, i: gm.grouped_matmul(x, w, i, interpret=False))
    assert "xla.gpu.triton" in fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

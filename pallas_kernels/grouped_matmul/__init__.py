"""A mixture of experts' grouped matmul for NVIDIA GPUs, as a Pallas kernel on the Triton backend.

`tiles[s] @ W[index[s]]`: tile s of rows (one expert's tokens, model/moe.py's `grouped_swiglu`) times its own
expert, read straight from the stack of every expert `[G, K, N]` (a layer's experts, or every layer's:
`[L * E, K, N]`), so no expert is gathered or copied and only the experts a step's tiles name are read. The
host-side contract matches the CPU kernel's (`stacked_matmul.grouped_matmul`); XLA's gather-and-einsum is the
reference. Triton for the reasons `ragged_paged_attention/triton_gpu.py` gives: its lowering for CUDA runs on a
CPU-only machine (tests/kernels/test_grouped_matmul.py lowers it), and interpret mode checks its numerics.

Grid `(tile, column block)`. A program reads its tile's expert id, walks K in `block_k` chunks, multiplies the
tile's rows (padded to a power of two, at least 16: Triton's dot) by the expert's `[block_k, block_n]` slice
and accumulates in float32. `block_k` and `block_n` are the largest powers of two up to 128 that divide K and
N (an expert 768 wide, as Qwen3-30B-A3B's, takes 256 x 128 blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

try:  # Pallas Triton: `CompilerParams` since JAX 0.7, `TritonCompilerParams` before
    from jax.experimental.pallas import triton as _pltriton

    _TritonParams = getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams", None)
except ImportError:  # a JAX without the Triton backend: interpret mode still works
    _TritonParams = None

MIN_BLOCK = 16  # Triton's dot: every operand dimension at least 16
MAX_BLOCK = 128


def _block(n: int) -> int:
    """The largest power of two up to MAX_BLOCK dividing n (0 when below MIN_BLOCK)."""
    b = MAX_BLOCK
    while b >= MIN_BLOCK and n % b:
        b //= 2
    return b if b >= MIN_BLOCK else 0


def supports(w) -> bool:
    """Whether the kernel tiles this float stack of experts `[G, K, *N]`."""
    n = 1
    for d in w.shape[2:]:
        n *= d
    floats = jnp.issubdtype(w.dtype, jnp.floating)
    return w.ndim >= 3 and floats and bool(_block(w.shape[1])) and bool(_block(n)) and _TritonParams is not None


def _kernel(index_ref, x_ref, w_ref, o_ref, *, block_k: int):
    tile, column = pl.program_id(0), pl.program_id(1)
    expert = index_ref[tile]
    block_n = o_ref.shape[-1]

    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        x = x_ref[tile, :, pl.ds(k0, block_k)]
        w = w_ref[expert, pl.ds(k0, block_k), pl.ds(column * block_n, block_n)]
        return acc + jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)

    num_k = x_ref.shape[-1] // block_k
    o_ref[...] = lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))


def grouped_matmul(
    tiles: Float[Array, "S M K"],
    w: Float[Array, "G K *N"],
    index: Int[Array, " S"],
    *,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Float[Array, "S M *N"]:
    """`tiles[s] @ w[index[s]]` in float32 (`supports(w)` must hold). `interpret`: Pallas' interpreter (None:
    on CPU), which CI runs."""
    num_tiles, rows, k = tiles.shape
    out_shape = w.shape[2:]
    flat = jnp.reshape(w, (w.shape[0], k, -1))
    n = flat.shape[-1]
    block_k, block_n = _block(k), _block(n)
    block_m = max(MIN_BLOCK, 1 << max(0, rows - 1).bit_length())
    padded = jnp.pad(tiles, ((0, 0), (0, block_m - rows), (0, 0))) if block_m != rows else tiles
    if interpret is None:
        interpret = jax.default_backend() == "cpu"

    def full(x):  # the whole array: the kernel indexes it itself
        zeros = (0,) * x.ndim
        return pl.BlockSpec(x.shape, lambda s, j: zeros)

    params = {}
    if _TritonParams is not None:
        params["compiler_params"] = _TritonParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k),
        grid=(num_tiles, n // block_n),
        in_specs=[full(index), full(padded), full(flat)],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((num_tiles, block_m, n), jnp.float32),
        interpret=interpret,
        name="grouped_matmul",
        **params,
    )(index.astype(jnp.int32), padded, flat)
    return out[:, :rows].reshape(num_tiles, rows, *out_shape)

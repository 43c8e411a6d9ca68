"""`x @ w[layer]` where `w` stacks every decoder layer's weights `[L, K, ...]`.

The scanned model keeps each projection's weights stacked over layers and picks a layer
inside the scan. XLA's CPU backend copies the picked `[K, ...]` slice out of the stack
before its dot (a dot's operands must be buffers of their own): at a decode step's few
rows, where the dot is bound by reading the weights, the copy doubles the bytes moved —
measured 2x on the default model's matmul chain at one row (`benchmarks/NOTES.md`). The C++
kernel (`cpu_kernel.cc`'s handler, the float kernel in `float_panels.h`) reads the layer in place,
streaming the weights for a few rows and multiplying cache-resident panels of them with register
tiles for more (a prefill chunk):
measured 1.1-1.3x less CPU than the slice and XLA's dot from 8 to 512 rows.

Backends: "reference" (the slice and `dot_general`: every platform, the oracle), "cpu" (the
kernel), "auto" (the kernel when it applies and builds, else the reference) and "cpu_packed":
weights rearranged once by `pack` into the panels the kernel would otherwise copy per call
(same shape, panel-major contents), for every weight `packable` says yes to, "auto" for the
rest; measured 1.33x more GFLOP per CPU-second at 64 rows. Packed weights may be bfloat16
(x is then rounded to bfloat16 too): the kernel multiplies pairs of them with the CPU's
bfloat16 dot product, about twice its float32 rate, and accumulates in float32. The engine's runner packs its own
weights and picks it; an array that was not packed must never reach it. A single matrix (the
LM head) is a stack of one: `pack_matrix` and `packed_matmul`. The kernel has no
partitioning rule: a tensor-parallel model must use "reference".
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_ffi

BACKENDS = ("auto", "reference", "cpu", "cpu_packed")
TARGET = "jaxllm_stacked_matmul_cpu"
PANEL = 32  # columns per panel: kPanel in float_panels.h
SOURCE = Path(__file__).with_name("cpu_kernel.cc")


def available() -> bool:
    return cpu_ffi.register(SOURCE, "StackedMatmulCpu", TARGET)


def _pair(dtype) -> int:
    """How many consecutive rows of K the kernel's tile reads as one: 2 for bfloat16 (its dot product's pairs)."""
    return 2 if dtype == jnp.bfloat16 else 1


def packable(w) -> bool:
    """Whether `pack` rearranges `w` (and "cpu_packed" reads it so): `[L, K, *N]`, N in whole panels,
    float32 or bfloat16 (K even: the kernel takes K in pairs)."""
    if w.ndim < 3 or math.prod(w.shape[2:]) % PANEL:
        return False
    return w.dtype in (jnp.float32, jnp.bfloat16) and w.shape[1] % _pair(w.dtype) == 0


def pack(w):
    """`[L, K, *N]` → the same shape holding each layer as `[N / 32, K, 32]` panels (host or device array);
    bfloat16 as `[N / 32, K / 2, 32, 2]`: the two of each pair of K side by side, as the dot product reads them."""
    num_layers, k = w.shape[:2]
    n, pair = math.prod(w.shape[2:]), _pair(w.dtype)
    xp = jnp if isinstance(w, jax.Array) else np
    pairs = xp.reshape(w, (num_layers, k // pair, pair, n // PANEL, PANEL))
    return xp.reshape(xp.transpose(pairs, (0, 3, 1, 4, 2)), w.shape)


def pack_matrix(w, *, transposed: bool = False):
    """One `[K, N]` weight (`transposed`: stored `[N, K]`, as a tied embedding) packed as a one-layer stack;
    the shape stays the one given (abstract params unchanged), the contents are `[N / 32, K, 32]` panels."""
    xp = jnp if isinstance(w, jax.Array) else np
    return xp.reshape(pack((w.T if transposed else w)[None]), w.shape)


def packed_rows(w, index: Int[Array, " T"]):
    """Rows `index` of E from `w = pack_matrix(E, transposed=True)` (a tied embedding's lookup): row v is
    column v of the packed [K, N] matrix, column v % 32 of panel v // 32."""
    n, k = w.shape
    pair = _pair(w.dtype)
    rows = jnp.reshape(w, (n // PANEL, k // pair, PANEL, pair))[index // PANEL, :, index % PANEL]
    return jnp.reshape(rows, (index.shape[0], k))


def packed_matmul(x: Float[Array, "T K"], w, *, kernel_max_rows: int | None = None) -> Float[Array, "T N"]:
    """`x @ W` in float32 for `w = pack_matrix(W)` (or `pack_matrix(W.T, transposed=True)`): through the kernel,
    or XLA's dot on the packed layout for more than `kernel_max_rows` rows (see `stacked_matmul`)."""
    k = x.shape[-1]
    return _packed(x, jnp.reshape(w, (1, k, w.size // k)), 0, kernel_max_rows)


def _packed(x, w, layer, kernel_max_rows: int | None):
    """`x @ W[layer]` in float32 for `w = pack(W)`: the kernel up to `kernel_max_rows` rows of x, XLA's dot above."""
    if kernel_max_rows is not None and x.shape[0] > kernel_max_rows:
        return stacked_matmul_packed_xla(x, w, layer)
    return stacked_matmul_cpu(x.astype(w.dtype), w, layer, packed=True)


def grouped_matmul(
    tiles: Float[Array, "S M K"], w, index: Int[Array, " S"], *, kernel_max_rows: int | None = None
) -> Float[Array, "S M *N"]:
    """Each tile of rows times its own layer of `w = pack(W)`, `tiles[s] @ W[index[s]]` in float32: a mixture of
    experts' grouped matmul, each expert a layer of the stack. One kernel call runs every tile in place; above
    `kernel_max_rows` rows a tile, XLA's dot on the packed layout tile by tile."""
    s, m, k = tiles.shape
    if kernel_max_rows is not None and m > kernel_max_rows:
        return jax.lax.map(lambda a: stacked_matmul_packed_xla(a[0], w, a[1]), (tiles, index)).astype(jnp.float32)
    out = stacked_matmul_cpu(jnp.reshape(tiles, (s * m, k)).astype(w.dtype), w, index, packed=True)
    return jnp.reshape(out, (s, m, *w.shape[2:]))


def kernel_applies(x, w) -> bool:
    return jax.default_backend() == "cpu" and x.dtype == jnp.float32 and w.dtype == jnp.float32 and available()


def stacked_matmul(
    x: Float[Array, "T K"],
    w: Float[Array, "L K *N"],
    layer: Int[Array, ""] | int,
    *,
    backend: str = "auto",
    kernel_max_rows: int | None = None,
) -> Float[Array, " T *N"]:
    """`x @ w[layer]`, contracting x's last axis with the layer's first. `kernel_max_rows` ("cpu_packed"):
    above that many rows of x, XLA's dot on the packed layout instead of the kernel (where the machine's
    self-check, `pallas_kernels.cpu_choice`, found XLA faster); None: the kernel for every row count."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cpu_packed" and packable(w):
        return _packed(x, w, layer, kernel_max_rows).astype(jnp.result_type(x, w))
    if backend == "cpu" or (backend in ("auto", "cpu_packed") and kernel_applies(x, w)):
        return stacked_matmul_cpu(x, w, layer)
    return stacked_matmul_reference(x, w, layer)


def stacked_matmul_reference(x, w, layer):
    one = jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
    out = jax.lax.dot_general(x.astype(w.dtype), one, (((x.ndim - 1,), (0,)), ((), ())))
    return out.astype(jnp.result_type(x, w))


def stacked_matmul_packed_xla(x, w, layer):
    """`x @ W[layer]` in float32 by XLA's dot reading `w = pack(W)` as it is (`[N / 32, K, 32]` panels, bfloat16
    `[N / 32, K / 2, 32, 2]`), so a step that prefers XLA for some row counts needs no second, unpacked copy."""
    one = jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
    k, n, pair = one.shape[0], math.prod(one.shape[1:]), _pair(w.dtype)
    panels = jnp.reshape(one, (n // PANEL, k // pair, PANEL, pair))
    xs = jnp.reshape(x.astype(w.dtype), (x.shape[0], k // pair, pair))
    out = jnp.einsum("tqj,pqcj->tpc", xs, panels, preferred_element_type=jnp.float32)
    return out.reshape(x.shape[0], *w.shape[2:])


def stacked_matmul_cpu(x, w, layer, *, packed: bool = False):
    """The kernel, float32 out; `packed`: `w` as `pack` returns it (float32, or bfloat16 with x bfloat16).
    `layer`: one index, or S (x's rows then S tiles, each times its own layer: `grouped_matmul`)."""
    if not available():
        raise RuntimeError("the CPU stacked-matmul kernel could not be built (see the warning above)")
    dtypes_ok = x.dtype == w.dtype == jnp.float32 or (packed and x.dtype == w.dtype == jnp.bfloat16)
    if x.ndim != 2 or not dtypes_ok:
        raise ValueError(
            f"the CPU kernel takes float32 x [T, K] and w [L, K, ...] (or both bfloat16, packed), "
            f"got {x.dtype}{x.shape}, {w.dtype}{w.shape}"
        )
    out = jax.ShapeDtypeStruct((x.shape[0], math.prod(w.shape[2:])), jnp.float32)
    flat = jax.ffi.ffi_call(TARGET, out)(x, w, jnp.reshape(jnp.asarray(layer, jnp.int32), (-1,)), packed=packed)
    return flat.reshape(x.shape[0], *w.shape[2:])

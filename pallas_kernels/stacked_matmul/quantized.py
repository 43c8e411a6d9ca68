"""`x @ W[layer]` for weights kept quantized (GGUF Q8_0 / Q4_0 / Q4_1 blocks, jaxllm's int8 / int4): float32 x.

A stacked weight of logical float shape `[L, K, *N]` is a `QuantizedWeight` of its quants and per-group
float16 scales (and mins), N innermost like the float weights:

- `qs`: int8 `[L, K, *N]` (8-bit, signed), or uint8 `[L, K // 2, *N]` (4-bit): for group b of 32 k's and
  j in 0..15, row 16*b + j holds k = 32*b + j in its low nibble and k = 32*b + 16 + j in its high nibble
  (GGUF's own nibble order, transposed so that N is innermost);
- `scales`: float16 `[L, K // G, *N]`, G the group size along K (G = K: one scale per output channel);
- `mins`: float16 `[L, K // G, *N]` (Q4_1) or None.

Weight (k, n) of group g = k // G is `d * q` (8-bit), `d * q + m` (4-bit with mins, q in 0..15) or
`d * (q - 8)` (4-bit without mins); 8-bit with mins is not a format. Bits, G and the min are read off the
dtypes and shapes. Activations are not quantized: every path equals the float32 matmul on the
dequantized weights up to summation order.

Backends of `quantized_matmul`: "reference" (unpacked weights: XLA dequantizes the layer and runs its dot;
every platform, and the tensor-parallel path: qs, scales and mins sharded alike along N or K partition as
an ordinary dot) and "cpu_packed" (every array `pack`ed into 32-column panels like the float "cpu_packed"
weights: the C++ kernel in `quant_panels.h`, which dequantizes in registers, up to `kernel_max_rows` rows,
XLA's dequantize-and-dot on the same packed arrays above).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_ffi
from pallas_kernels import stacked_matmul as sm

TARGET = "jaxllm_quantized_matmul_cpu"
PANEL = sm.PANEL
STREAM_ROWS = 4  # quant_panels.h's kQuantStreamRows: up to this many rows, the kernel's few-row code
INT_STREAM_ROWS = 32  # int_panels.h's kIntStreamRows: the integer path's few-row code, where quads fit registers


def int8_few_rows() -> bool:
    """Whether the kernel's integer path serves the few-row regime too (cpu_simd.h's kQuadsInRegisters:
    AVX512-VBMI, NEON, SSE-only targets); elsewhere those rows keep float activations."""
    macros = cpu_ffi.target_macros()
    return "__AVX512VBMI__" in macros or "__aarch64__" in macros or ("__SSE2__" in macros and "__AVX__" not in macros)


class QuantFormat(NamedTuple):
    bits: int
    group: int | None  # weights of K per scale; None: one group per whole column (per output channel)
    has_min: bool


FORMATS: dict[str, QuantFormat] = {
    "q8_0": QuantFormat(8, 32, False),
    "q4_0": QuantFormat(4, 32, False),
    "q4_1": QuantFormat(4, 32, True),
    "int8": QuantFormat(8, None, False),
    "int4": QuantFormat(4, 32, True),  # Q4_1's layout: a scale and a minimum (GPTQ/AWQ's zero point) per group
}


class QuantizedWeight(NamedTuple):
    """A stacked weight of logical shape `[L, K, *N]` kept in its quants (see the module docstring)."""

    qs: Array | np.ndarray  # int8 [L, K, *N] or uint8 [L, K // 2, *N] (device or host arrays)
    scales: Array | np.ndarray  # float16 [L, K // G, *N]
    mins: Array | np.ndarray | None  # float16 [L, K // G, *N] or None


class _Layout(NamedTuple):
    bits: int
    k: int  # the logical K
    group: int
    n: int  # the flattened N


def _layout(qw: QuantizedWeight) -> _Layout:
    """Bits, K, G and N of `qw`, checked; ValueError when it is not a weight of a supported format."""
    qs, scales, mins = qw
    if qs.dtype == jnp.int8:
        bits = 8
    elif qs.dtype == jnp.uint8:
        bits = 4
    else:
        raise ValueError(f"qs must be int8 (8-bit) or uint8 (4-bit), got {qs.dtype}")
    if qs.ndim < 3 or scales.ndim != qs.ndim or scales.dtype != jnp.float16:
        raise ValueError(
            f"qs [L, K, *N] and float16 scales [L, K // G, *N] expected, got {qs.shape}, {scales.dtype}{scales.shape}"
        )
    k = qs.shape[1] * (2 if bits == 4 else 1)
    if scales.shape[0] != qs.shape[0] or scales.shape[2:] != qs.shape[2:] or not scales.shape[1] or k % scales.shape[1]:
        raise ValueError(f"scales {scales.shape} do not match qs {qs.shape} (K = {k})")
    group = k // scales.shape[1]
    if mins is not None:
        if bits == 8:
            raise ValueError("8-bit weights with mins are not a supported format")
        if mins.shape != scales.shape or mins.dtype != jnp.float16:
            raise ValueError(f"mins must be float16 {scales.shape}, got {mins.dtype}{mins.shape}")
    if bits == 4 and group % 32:
        raise ValueError(f"4-bit groups must be whole blocks of 32 along K, got G = {group}")
    return _Layout(bits, k, group, math.prod(qs.shape[2:]))


def packable(qw: QuantizedWeight) -> bool:
    """Whether `pack` rearranges `qw` and the kernel reads it: valid dtypes, N in whole panels of 32, K in whole
    blocks of 32 where grouped."""
    try:
        lay = _layout(qw)
    except ValueError:
        return False
    return lay.n % PANEL == 0 and (lay.group == lay.k or lay.k % 32 == 0)


def _pack_array(a):
    num_layers, rows = a.shape[:2]
    n = math.prod(a.shape[2:])
    xp = jnp if isinstance(a, jax.Array) else np
    panels = xp.reshape(a, (num_layers, rows, n // PANEL, PANEL))
    return xp.reshape(xp.transpose(panels, (0, 2, 1, 3)), a.shape)


def pack(qw: QuantizedWeight) -> QuantizedWeight:
    """Every array of `qw` panel-major over N (as `stacked_matmul.pack`: same shapes, each layer's contents
    `[N / 32, rows, 32]`); host (numpy) or device arrays."""
    if not packable(qw):
        raise ValueError("not packable: N must be whole panels of 32 and K whole blocks of 32")
    return QuantizedWeight(
        _pack_array(qw.qs), _pack_array(qw.scales), None if qw.mins is None else _pack_array(qw.mins)
    )


def _dequant(qs, scales, mins, bits: int, dtype):
    """`[Kq, *C]` quants with `[K // G, *C]` scales (and mins) → `[K, *C]` in `dtype`, the formulas in float32."""
    cols = qs.shape[1:]
    if bits == 4:
        q = jnp.reshape(qs, (qs.shape[0] // 16, 1, 16, *cols))
        q = jnp.concatenate([q & 15, q >> 4], axis=1)  # each block of 32: its low nibbles, then its high ones
        q = jnp.reshape(q, (qs.shape[0] * 2, *cols)).astype(jnp.float32)
        if mins is None:
            q = q - 8.0
    else:
        q = qs.astype(jnp.float32)
    k, groups = q.shape[0], scales.shape[0]

    def expand(a):
        a = jnp.broadcast_to(a.astype(jnp.float32)[:, None], (groups, k // groups, *cols))
        return jnp.reshape(a, (k, *cols))

    w = expand(scales) * q
    if mins is not None:
        w = w + expand(mins)
    return w.astype(dtype)


def dequantize(qw: QuantizedWeight, layer: Int[Array, ""] | int, *, packed: bool, dtype=jnp.float32):
    """Layer `layer` of `qw` as `[K, *N]` in `dtype` (XLA; `layer` may be traced); `packed`: `qw` as `pack`
    returns it (the result is then in the logical layout all the same)."""
    lay = _layout(qw)

    def one(a):
        return None if a is None else jax.lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False)

    qs, scales, mins = (one(a) for a in qw)
    if not packed:
        return _dequant(qs, scales, mins, lay.bits, dtype)
    qs, scales, mins = _panels(qs, scales, mins, lay)
    panels = _dequant(qs, scales, mins, lay.bits, dtype)  # [K, P, 32]
    return jnp.reshape(panels, (lay.k, *qw.qs.shape[2:]))


def dequantize_each(qw: QuantizedWeight, dtype=jnp.float32):
    """Every weight of an unpacked stack `[S, Kq, *N]` as `[S, K, *N]` in `dtype` (XLA): e.g. the experts a
    step's tiles gathered (jaxllm/model/moe.py)."""
    lay = _layout(qw)
    return jax.vmap(lambda qs, scales, mins: _dequant(qs, scales, mins, lay.bits, dtype))(*qw)


def _panels(qs, scales, mins, lay: _Layout):
    """One packed layer's arrays viewed as `[rows, P, 32]` (rows of each panel's first, P panels)."""

    def view(a):
        if a is None:
            return None
        rows = a.shape[0]
        return jnp.transpose(jnp.reshape(a, (lay.n // PANEL, rows, PANEL)), (1, 0, 2))

    return view(qs), view(scales), view(mins)


def quantized_matmul(
    x: Float[Array, "T K"],
    qw: QuantizedWeight,
    layer: Int[Array, ""] | int,
    *,
    backend: str,
    kernel_max_rows: int | None = None,
    int8_min_rows: int = 0,
) -> Float[Array, " T *N"]:
    """`x @ W[layer]` in float32 for the quantized W. backend "reference": `qw` unpacked, XLA's dequantize and
    dot; "cpu_packed": `qw = pack(...)`, the C++ kernel up to `kernel_max_rows` rows of x (None: every row
    count), its integer path from `int8_min_rows` rows (0: never), above it XLA's dequantize and dot on the
    packed arrays."""
    out_shape = (x.shape[0], *qw.qs.shape[2:])
    if backend == "reference":
        lay = _layout(qw)
        qs, scales, mins = (_layer(a, layer) for a in qw)
        return _matmul_xla(x, qs, scales, mins, lay.bits)
    if backend != "cpu_packed":
        raise ValueError(f"backend must be 'reference' or 'cpu_packed', got {backend!r}")
    if (kernel_max_rows is not None and x.shape[0] > kernel_max_rows) or not available():
        return quantized_matmul_packed_xla(x, qw, layer)  # also where the kernel did not build (warned once)
    return jnp.reshape(quantized_matmul_cpu(x, qw, layer, int8_min_rows=int8_min_rows), out_shape)


def grouped_quantized_matmul(
    tiles: Float[Array, "S M K"],
    qw: QuantizedWeight,
    index: Int[Array, " S"],
    *,
    kernel_max_rows: int | None = None,
    int8_min_rows: int = 0,
) -> Float[Array, "S M *N"]:
    """`tiles[s] @ W[index[s]]` in float32 for `qw = pack(...)`, each tile of rows times its own layer (a mixture of
    experts' grouped matmul, `sm.grouped_matmul`'s quantized twin): one kernel call for every tile, XLA tile by
    tile above `kernel_max_rows` rows a tile or where the kernel did not build."""
    s, m, k = tiles.shape
    if (kernel_max_rows is not None and m > kernel_max_rows) or not available():
        return jax.lax.map(lambda a: quantized_matmul_packed_xla(a[0], qw, a[1]), (tiles, index))
    out = quantized_matmul_cpu(jnp.reshape(tiles, (s * m, k)), qw, index, int8_min_rows=int8_min_rows)
    return jnp.reshape(out, (s, m, *qw.qs.shape[2:]))


def quantized_matmul_packed_xla(x, qw: QuantizedWeight, layer) -> Array:
    """`x @ W[layer]` by XLA on the packed arrays as they are (dequantized panels `[K, P, 32]`, one dot)."""
    lay = _layout(qw)
    qs, scales, mins = _panels(_layer(qw.qs, layer), _layer(qw.scales, layer), _layer(qw.mins, layer), lay)
    return _matmul_xla(x, qs, scales, mins, lay.bits).reshape(x.shape[0], *qw.qs.shape[2:])


def _layer(a, layer):
    return None if a is None else jax.lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False)


def _matmul_xla(x, qs, scales, mins, bits: int):
    """`x [T, K] @ W [K, *C]` in float32 by XLA from one layer's `[Kq, *C]` quants and `[K // G, *C]` scales (and
    mins). 8-bit: the dequantized layer and one dot. 4-bit: each block's low and high nibbles dequantized and
    multiplied apart (x's k = 32 b + j and 32 b + 16 + j), two dots over (block, j): interleaving the nibbles
    back into K first costs XLA's CPU backend a copy of the layer (measured 2.4x slower at 1 row, 1.6x at 64)."""
    x = x.astype(jnp.float32)
    if bits == 8:
        w = _dequant(qs, scales, mins, bits, jnp.float32)
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))
    cols, blocks = qs.shape[1:], qs.shape[0] // 16
    q = jnp.reshape(qs, (blocks, 16, *cols))
    per_block = blocks // scales.shape[0]  # G / 32 blocks a scale

    def expand(a):
        return jnp.repeat(a.astype(jnp.float32), per_block, axis=0)[:, None]

    d = expand(scales)
    m = expand(mins) if mins is not None else -8.0 * d
    xs = jnp.reshape(x, (x.shape[0], blocks, 2, 16))
    out = None
    for half, nibble in enumerate((q & 15, q >> 4)):
        w = d * nibble.astype(jnp.float32) + m
        part = jax.lax.dot_general(xs[:, :, half], w, (((1, 2), (0, 1)), ((), ())))
        out = part if out is None else out + part
    return out


def available() -> bool:
    return cpu_ffi.register(sm.SOURCE, "QuantizedMatmulCpu", TARGET)


def quantized_matmul_cpu(x, qw: QuantizedWeight, layer, *, int8_min_rows: int = 0) -> Array:
    """The C++ kernel on packed `qw`: float32 `[T, N]` (N flattened). `layer`: one index, or S (x's rows then S
    tiles, each times its own layer). `int8_min_rows` > 0: from that many rows on (past the few-row regime), x is
    quantized to int8 blocks (`quantize_rows`) and multiplied by integer dot instructions (int_panels.h)."""
    if not available():
        raise RuntimeError("the CPU stacked-matmul kernel could not be built (see the warning above)")
    lay = _layout(qw)
    if x.ndim != 2 or x.shape[1] != lay.k or not packable(qw):
        raise ValueError(f"x [T, {lay.k}] and a packable weight expected, got x {x.shape}")
    mins = qw.mins if qw.mins is not None else jnp.zeros((0,), jnp.float16)
    out = jax.ShapeDtypeStruct((x.shape[0], lay.n), jnp.float32)
    index = jnp.reshape(jnp.asarray(layer, jnp.int32), (-1,))
    call = jax.ffi.ffi_call(TARGET, out)
    return call(x.astype(jnp.float32), qw.qs, qw.scales, mins, index, int8_min_rows=np.int64(int8_min_rows))


def quantized_rows(qw: QuantizedWeight, index: Int[Array, " T"], *, packed: bool, dtype=jnp.float32):
    """Rows `index` of E `[T, K]` in `dtype` for a tied embedding stored as the one-layer stack of E.T (`qw` of
    logical shape `[1, K, V]`): row v is column v of the `[K, V]` matrix, dequantized; `packed`: column v % 32 of
    panel v // 32."""
    lay = _layout(qw)

    def cols(a):
        if a is None:
            return None
        a = a[0]
        if packed:
            rows = a.shape[0]
            return jnp.transpose(jnp.reshape(a, (lay.n // PANEL, rows, PANEL))[index // PANEL, :, index % PANEL])
        return jnp.reshape(a, (a.shape[0], lay.n))[:, index]

    qs, scales, mins = (cols(a) for a in qw)
    return jnp.transpose(_dequant(qs, scales, mins, lay.bits, dtype))


def random_weight(rng: np.random.Generator, fmt: str, shape: tuple[int, ...]) -> QuantizedWeight:
    """A random `fmt` weight of logical shape `(L, K, *N)` in numpy (unpacked): no quant dequantizes to zero
    (8-bit q never 0, Q4_0 q never 8, Q4_1 / int4 mins keep `d * q + m` off zero), scales and mins nonzero."""
    f = FORMATS[fmt]
    num_layers, k, *n = shape
    group = f.group or k
    if k % group or (f.bits == 4 and k % 32):
        raise ValueError(f"K = {k} is not whole groups of {group}")
    groups_shape = (num_layers, k // group, *n)
    scales = (rng.uniform(0.5, 1.5, groups_shape) * rng.choice([-1, 1], groups_shape) * 0.01).astype(np.float16)
    if f.bits == 8:
        q = rng.integers(1, 128, shape) * rng.choice([-1, 1], shape)
        return QuantizedWeight(q.astype(np.int8), scales, None)
    if f.has_min:
        q = rng.integers(0, 16, shape)
        scales = np.abs(scales)
        mins = (-scales.astype(np.float32) * rng.choice([8.25, 8.5, 8.75], groups_shape)).astype(np.float16)
    else:
        q = rng.integers(0, 15, shape)
        q = q + (q >= 8)  # 0..15 without 8
        mins = None
    blocks = q.reshape(num_layers, k // 32, 2, 16, *n)
    qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(num_layers, k // 2, *n).astype(np.uint8)
    return QuantizedWeight(qs, scales, mins)


def _dequant_numpy(qw: QuantizedWeight, layer: int) -> np.ndarray:
    """Layer `layer` of unpacked `qw` as float64 `[K, *N]`, straight from the formulas."""
    qs = np.asarray(qw.qs[layer])
    scales = np.asarray(qw.scales[layer]).astype(np.float64)
    if qs.dtype == np.uint8:
        blocks = qs.reshape(qs.shape[0] // 16, 1, 16, *qs.shape[1:]).astype(np.int64)
        q = np.concatenate([blocks & 15, blocks >> 4], axis=1).reshape(qs.shape[0] * 2, *qs.shape[1:])
        if qw.mins is None:
            q = q - 8
    else:
        q = qs.astype(np.int64)
    group = q.shape[0] // scales.shape[0]
    w = np.repeat(scales, group, axis=0) * q
    if qw.mins is not None:
        w = w + np.repeat(np.asarray(qw.mins[layer]).astype(np.float64), group, axis=0)
    return w


def quantize_rows(x) -> tuple[np.ndarray, np.ndarray]:
    """x `[T, K]` as the integer path quantizes it (llama.cpp's `quantize_row_q8_1`): each block of 32 to int8,
    round-to-nearest-even of x * 127 / max|x|, with its float32 scale max|x| / 127. Returns (q `[T, K]` int8,
    scales `[T, K // 32]`); q * scales is what that path multiplies."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int8).reshape(x.shape)
    return q, amax / np.float32(127)


def dequantize_rows(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`quantize_rows`' blocks back to float32 `[T, K]`."""
    return (q.reshape(q.shape[0], -1, 32) * scales[:, :, None]).reshape(q.shape).astype(np.float32)


def reference_matmul(x, qw: QuantizedWeight, layer: int) -> np.ndarray:
    """The oracle: `x @ W[layer]` in float64 numpy, W dequantized from the formulas (unpacked `qw`)."""
    w = _dequant_numpy(qw, layer)
    k = w.shape[0]
    return (np.asarray(x, np.float64) @ w.reshape(k, -1)).reshape(x.shape[0], *w.shape[1:])

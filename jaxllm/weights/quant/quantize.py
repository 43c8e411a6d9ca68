"""Float weights → the quantized arrays the model reads (`QuantizedWeight` parts), in the kernel layout.

A weight here is stored as the model stores a kernel, `[K, *N]` (input first), and quantized along K:
- "int8": symmetric, one scale per output channel (a group of all K): `d = max|w| / 127`, `q = round(w / d)`.
- "int4": GGUF's Q4_0 on groups of 32 along K: `d = w_max / -8` (w_max the value of largest magnitude,
  with its sign), `q = clip(round(w / d) + 8, 0, 15)`, value `d * (q - 8)`; so the extreme weight is exact.
Scales are float16 (as in GGUF); q is computed from the float16 scale, so the stored pair is consistent.
4-bit quants are packed two to a byte in GGUF's order (`pallas_kernels.stacked_matmul.quantized`).

`from_blocks` turns a GGUF tensor kept in its bits (`gguf_blocks.QuantizedTensor`, `[out, in]` rows) into
the same `[K', out]` layout without touching a value.
"""

from __future__ import annotations

import numpy as np

from jaxllm.weights.quant.gguf_blocks import QuantizedTensor
from pallas_kernels.stacked_matmul.quantized import FORMATS

Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # (qs, scales, mins)


def quantize_kernel(w: np.ndarray, fmt: str) -> Parts:
    """`w` float `[K, *N]` → (qs, scales, mins) in format "int8" or "int4" (see the module docstring)."""
    w = np.asarray(w, np.float32)
    k, out_shape = w.shape[0], w.shape[1:]
    spec = FORMATS[fmt]
    group = k if spec.group is None else spec.group
    if k % group:
        raise ValueError(f"{fmt}: {k} inputs is not a multiple of the group size {group}")
    grouped = w.reshape(k // group, group, *out_shape)
    if fmt == "int8":
        scale = (np.abs(grouped).max(axis=1) / 127).astype(np.float16)
        q = np.rint(grouped / _nonzero(scale)[:, None]).clip(-127, 127).astype(np.int8)
        return q.reshape(w.shape), scale, None
    if fmt == "int4":
        index = np.abs(grouped).argmax(axis=1)[:, None]
        extreme = np.take_along_axis(grouped, index, axis=1)[:, 0]
        scale = (extreme / -8).astype(np.float16)
        q = (np.rint(grouped / _nonzero(scale)[:, None]) + 8).clip(0, 15).astype(np.uint8)
        return pack_nibbles(q.reshape(w.shape)), scale, None
    raise ValueError(f"quantize_kernel makes int8 and int4, not {fmt!r}")


def _nonzero(scale: np.ndarray) -> np.ndarray:
    """The scale as float32, with 1 where it is 0 (an all-zero group: every q is then 0)."""
    scale = scale.astype(np.float32)
    return np.where(scale == 0, np.float32(1), scale)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 `[K, *N]` → `[K / 2, *N]`: row 16b + j holds k = 32b + j low, 32b + 16 + j high."""
    blocks = q.reshape(q.shape[0] // 32, 2, 16, *q.shape[1:])
    return (blocks[:, 0] | (blocks[:, 1] << 4)).reshape(q.shape[0] // 2, *q.shape[1:])


def from_blocks(qt: QuantizedTensor) -> Parts:
    """A GGUF tensor kept in its bits, `[out, in]` → (qs, scales, mins) `[K', out]`, bits unchanged."""
    mins = None if qt.mins is None else qt.mins.T
    return qt.qs.T, qt.scales.T, mins

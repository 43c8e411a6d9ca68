"""Float weights → the quantized arrays the model reads (`QuantizedWeight` parts), in the kernel layout.

A weight here is stored as the model stores a kernel, `[K, *N]` (input first), and quantized along K:
- "int8": symmetric, one scale per output channel (a group of all K): `d = max|w| / 127`, `q = round(w / d)`.
- "int4": asymmetric, GGUF's Q4_1 on groups of 32 along K (GPTQ's and AWQ's int4 carry a zero point too):
  `m = min(w)`, `d = (max(w) - m) / 15`, `q = clip(round((w - m) / d), 0, 15)`, value `d * q + m`. A
  symmetric scale alone (Q4_0) cost the default model 17 % perplexity (docs/quantization.md); with the
  minimum, re-quantizing its Q4_1 weights gives them back exactly.
Scales and minimums are float16 (as in GGUF); q is computed from the float16 values, so what is stored is
consistent.
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
        low = grouped.min(axis=1).astype(np.float16)
        scale = ((grouped.max(axis=1) - low.astype(np.float32)) / 15).astype(np.float16)
        shifted = grouped - low.astype(np.float32)[:, None]
        q = np.rint(shifted / _nonzero(scale)[:, None]).clip(0, 15).astype(np.uint8)
        return pack_nibbles(q.reshape(w.shape)), scale, low
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

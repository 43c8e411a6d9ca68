"""GGUF's Q8_0, Q4_0 and Q4_1 tensors repacked into arrays that keep their bits.

A GGUF block holds 32 consecutive weights of one row (along GGUF's innermost dimension, `ne[0]`):

- Q8_0 (34 bytes): fp16 scale `d`, then 32 int8 quants `q`; `w = d * q`.
- Q4_0 (18 bytes): fp16 `d`, then 16 bytes of 4-bit quants `q` in 0..15; `w = d * (q - 8)`.
- Q4_1 (20 bytes): fp16 `d`, fp16 min `m`, then 16 bytes of 4-bit quants; `w = d * q + m`.

Layout of a `QuantizedTensor` (the "block-split, row-major" layout): the interleaved blocks are split
into a quants array and per-block scale (and min) arrays, all row-major, so that row `r`'s block `b`
is `qs[r, b*B : (b+1)*B]` (B = 32 bytes for Q8_0, 16 for Q4_*), `scales[r, b]` and `mins[r, b]`.

- `shape` is `(rows, cols)`: `cols` is GGUF's innermost dimension `ne[0]` (the input dimension of a
  weight matrix, transformers' `[out, in]` second axis), `rows` every outer dimension flattened.
- `qs`: int8 `[rows, cols]` for Q8_0; uint8 `[rows, cols // 2]` for Q4_0 and Q4_1, in GGUF's own
  nibble order within a block: byte `j` (0..15) of a block holds weight `j` in its low nibble and
  weight `j + 16` in its high nibble (so `qs & 0xF` gives the block's first 16 weights and
  `qs >> 4` the last 16: one load, one mask, one shift in SIMD). Q4_0 keeps the unsigned nibble;
  the `- 8` is applied on dequantization.
- `scales`: float16 `[rows, cols // 32]`; `mins`: float16 `[rows, cols // 32]` for Q4_1, else None.

Bits are kept exactly: `to_gguf_bytes(repack(raw, t))` gives back `raw`, and `dequantize` follows
the formulas above in float32 (fp16 → float32 is exact, then one multiply, and for Q4_1 one add,
each rounded once), so it equals the `gguf` package's dequantization bit for bit.

Next step (not done here): the CPU kernel will read panels of rows (e.g. 32 rows' block `b` stored
together so a register tile loads contiguous bytes); that repack is a separate function over this
layout (`to_panels(qt, panel=32)`), to be shaped by the kernel's tiling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights per block, every format here

# format name → (GGML type id, bytes per block, bytes of fp16 fields before the quants)
FORMATS: dict[str, tuple[int, int, int]] = {
    "Q8_0": (8, 34, 2),
    "Q4_0": (2, 18, 2),
    "Q4_1": (3, 20, 4),
}
_BY_ID = {type_id: name for name, (type_id, _, _) in FORMATS.items()}


@dataclass(frozen=True)
class QuantizedTensor:
    """A GGUF-quantized tensor in the block-split, row-major layout (see the module docstring)."""

    format: str  # "Q8_0", "Q4_0" or "Q4_1"
    shape: tuple[int, int]  # (rows, cols): cols is GGUF's innermost dimension
    qs: np.ndarray  # int8 [rows, cols] (Q8_0) or uint8 [rows, cols // 2] (Q4_*)
    scales: np.ndarray  # float16 [rows, cols // 32]
    mins: np.ndarray | None  # float16 [rows, cols // 32] for Q4_1, else None

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)


def format_name(ggml_type) -> str:
    """The format's name for a GGML type (an id, a `gguf.GGMLQuantizationType` or a name); ValueError
    naming the type if it is not one kept quantized here."""
    if isinstance(ggml_type, str):
        name = ggml_type
    else:
        type_id = int(ggml_type)
        if type_id in _BY_ID:
            return _BY_ID[type_id]
        name = getattr(ggml_type, "name", None) or _gguf_type_name(type_id)
    if name not in FORMATS:
        raise ValueError(
            f"GGML type {name} is not kept quantized (supported: {', '.join(FORMATS)}); dequantize it instead"
        )
    return name


def _gguf_type_name(type_id: int) -> str:
    try:
        import gguf

        return f"{gguf.GGMLQuantizationType(type_id).name} (id {type_id})"
    except Exception:
        return f"id {type_id}"


def repack(raw: np.ndarray, ggml_type, shape: tuple[int, ...] | None = None) -> QuantizedTensor:
    """Split a tensor's raw GGUF blocks (uint8 `[..., bytes per row]`, as `GGUFReader` or
    `GGUFFile._raw` give them) into a `QuantizedTensor`. `shape`, if given, is the tensor's logical
    shape in numpy order (outermost first; GGUF's dims reversed) and is checked against the bytes."""
    name = format_name(ggml_type)
    _, type_size, header = FORMATS[name]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"{name}: raw blocks must be uint8 bytes, got {raw.dtype}")
    if shape is not None and (len(shape) == 0 or shape[-1] % BLOCK):
        raise ValueError(f"{name}: {shape[-1] if shape else 0} columns is not a multiple of the block size {BLOCK}")
    row_bytes = raw.shape[-1] if raw.ndim else 0
    if raw.ndim == 0 or row_bytes == 0 or row_bytes % type_size:
        raise ValueError(
            f"{name}: {row_bytes} bytes per row is not a whole number of {type_size}-byte blocks "
            f"(a column count divisible by {BLOCK})"
        )
    blocks_per_row = row_bytes // type_size
    rows, cols = int(np.prod(raw.shape[:-1], dtype=np.int64)), blocks_per_row * BLOCK
    if shape is not None and (int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]) != (rows, cols):
        raise ValueError(f"{name}: shape {tuple(shape)} does not match {rows} rows of {row_bytes} bytes")
    blocks = raw.reshape(rows, blocks_per_row, type_size)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if name == "Q4_1" else None
    quants = blocks[..., header:].copy()  # owned: no view of the (memory-mapped) file
    qs = quants.view(np.int8).reshape(rows, cols) if name == "Q8_0" else quants.reshape(rows, cols // 2)
    return QuantizedTensor(name, (rows, cols), qs, scales, mins)


def to_gguf_bytes(qt: QuantizedTensor) -> np.ndarray:
    """The inverse of `repack`: uint8 `[rows, bytes per row]` GGUF blocks."""
    _, type_size, _ = FORMATS[qt.format]
    rows, cols = qt.shape
    nb = cols // BLOCK
    parts = [qt.scales.reshape(rows, nb, 1).view(np.uint8)]
    if qt.mins is not None:
        parts.append(qt.mins.reshape(rows, nb, 1).view(np.uint8))
    parts.append(qt.qs.view(np.uint8).reshape(rows, nb, -1))
    return np.concatenate(parts, axis=-1).reshape(rows, nb * type_size)


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """4-bit quants `[rows, cols // 2]` → uint8 values 0..15 `[rows, cols]`, in weight order."""
    rows = qs.shape[0]
    blocks = qs.reshape(rows, -1, 1, BLOCK // 2)
    both = np.concatenate([blocks & np.uint8(0x0F), blocks >> np.uint8(4)], axis=2)  # low: 0..15, high: 16..31
    return both.reshape(rows, -1)


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """float32 `[rows, cols]` values by the format's formula (pure numpy, exact per the docstring)."""
    rows, cols = qt.shape
    nb = cols // BLOCK
    d = qt.scales.astype(np.float32).reshape(rows, nb, 1)
    if qt.format == "Q8_0":
        q = qt.qs.astype(np.float32).reshape(rows, nb, BLOCK)
        w = d * q
    else:
        q = unpack_nibbles(qt.qs).astype(np.float32).reshape(rows, nb, BLOCK)
        if qt.format == "Q4_0":
            w = d * (q - np.float32(8))
        else:
            assert qt.mins is not None
            w = d * q + qt.mins.astype(np.float32).reshape(rows, nb, 1)
    return w.reshape(rows, cols)

"""GGUF Q8_0 / Q4_0 / Q4_1 blocks kept as their bits: repacking checked bit for bit against the
`gguf` package's own dequantization, on random blocks and on the default model's file."""

import gguf
import numpy as np
import pytest

from jaxllm.weights.quant.gguf_blocks import QuantizedTensor, dequantize, repack, to_gguf_bytes, unpack_nibbles

TYPES = {name: gguf.GGMLQuantizationType[name] for name in ("Q8_0", "Q4_0", "Q4_1")}


def _finite_fp16(rng, shape) -> np.ndarray:
    """Random fp16 values over the whole range (normal and subnormal), finite and not all zero."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent all ones (inf/NaN) → a finite value
    values = bits.view(np.float16)
    values.flat[0] = np.float16(0.0123)  # never all zeros
    return values


def random_blocks(kind: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """uint8 `[rows, bytes per row]` of random quants with random finite fp16 scales (and mins)."""
    rng = np.random.default_rng(seed)
    block, type_size = gguf.GGML_QUANT_SIZES[TYPES[kind]]
    assert block == 32
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, type_size), dtype=np.uint8)
    fields = 2 if kind == "Q4_1" else 1
    header = _finite_fp16(rng, (rows, blocks_per_row, fields))
    raw[..., : 2 * fields] = header.view(np.uint8).reshape(rows, blocks_per_row, 2 * fields)
    return raw.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("rows,blocks_per_row", [(1, 1), (5, 3), (64, 18)])
def test_repack_dequantizes_like_gguf(kind, rows, blocks_per_row):
    raw = random_blocks(kind, rows, blocks_per_row, seed=rows * 100 + blocks_per_row)
    qt = repack(raw, TYPES[kind])
    cols = blocks_per_row * 32
    assert qt.format == kind and qt.shape == (rows, cols)
    assert qt.scales.dtype == np.float16 and qt.scales.shape == (rows, blocks_per_row)
    if kind == "Q8_0":
        assert qt.qs.dtype == np.int8 and qt.qs.shape == (rows, cols)
    else:
        assert qt.qs.dtype == np.uint8 and qt.qs.shape == (rows, cols // 2)
    assert (qt.mins is not None) == (kind == "Q4_1")
    if qt.mins is not None:
        assert qt.mins.dtype == np.float16 and qt.mins.shape == (rows, blocks_per_row)

    expected = gguf.quants.dequantize(raw, TYPES[kind])
    got = dequantize(qt)
    assert got.dtype == np.float32 and expected.dtype == np.float32
    assert np.isfinite(expected).all()
    assert np.array_equal(got, expected)
    assert np.array_equal(to_gguf_bytes(qt), raw)  # the bits are all there


def test_names_and_ids_are_accepted():
    raw = random_blocks("Q4_1", 2, 2)
    by_enum, by_id, by_name = repack(raw, TYPES["Q4_1"]), repack(raw, 3), repack(raw, "Q4_1")
    for qt in (by_id, by_name):
        assert np.array_equal(dequantize(qt), dequantize(by_enum))


def test_layout_is_the_documented_one():
    """Row r's block b: scales[r, b], qs[r, 16b:16b+16] with weight j in the low nibble of byte j and
    weight j+16 in its high nibble; Q4_0 keeps the unsigned nibble and subtracts 8 on dequantization."""
    qs = np.zeros((1, 32), np.uint8)  # one row, two blocks
    qs[0, :16] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    qs[0, 16:] = 0x5A
    values = unpack_nibbles(qs)
    assert values[0, :16].tolist() == list(range(16))
    assert values[0, 16:32].tolist() == list(range(15, -1, -1))
    assert values[0, 32:48].tolist() == [0xA] * 16 and values[0, 48:].tolist() == [0x5] * 16
    qt = QuantizedTensor("Q4_0", (1, 64), qs, np.array([[1.0, 2.0]], np.float16), None)
    w = dequantize(qt)
    assert w[0, 0] == -8.0 and w[0, 15] == 7.0 and w[0, 32] == 4.0 and w[0, 48] == -6.0


@pytest.mark.parametrize("kind", list(TYPES))
def test_columns_not_divisible_by_32(kind):
    _, type_size = gguf.GGML_QUANT_SIZES[TYPES[kind]]
    with pytest.raises(ValueError, match="48 columns is not a multiple of the block size 32"):
        repack(random_blocks(kind, 4, 2), kind, shape=(4, 48))
    with pytest.raises(ValueError, match="not a whole number"):
        repack(np.zeros((4, type_size + 3), np.uint8), kind)


def test_unsupported_type_is_named():
    raw = np.zeros((2, 144), np.uint8)
    with pytest.raises(ValueError, match="Q4_K"):
        repack(raw, gguf.GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match="Q5_0"):
        repack(raw, int(gguf.GGMLQuantizationType.Q5_0))
    with pytest.raises(ValueError, match="F16"):
        repack(raw, "F16")


def test_shape_is_checked_against_the_bytes():
    raw = random_blocks("Q8_0", 4, 2)
    assert repack(raw, "Q8_0", shape=(2, 2, 64)).shape == (4, 64)
    with pytest.raises(ValueError, match="does not match"):
        repack(raw, "Q8_0", shape=(4, 96))


def test_default_model_tensors():
    """A Q4_1 layer and the Q8_0 token embedding of the default GGUF, read by jaxllm's own reader
    (the gguf package's GGUFReader takes seconds to build its metadata views)."""
    from jaxllm.weights.default import default_model_path
    from jaxllm.weights.gguf import GGUFFile

    model = GGUFFile(default_model_path())
    for name, kind, rows in (("blk.0.ffn_down.weight", "Q4_1", None), ("token_embd.weight", "Q8_0", 4096)):
        info = model._tensors[name]
        assert gguf.GGMLQuantizationType(info.ggml_type).name == kind
        raw = model._raw(name)
        raw = raw if rows is None else raw[-rows:]  # a slice of the 49152-row embedding keeps it fast
        shape = tuple(reversed(info.dims)) if rows is None else (rows, info.dims[0])
        qt = repack(raw, info.ggml_type, shape=shape)
        assert qt.format == kind and qt.shape == shape
        assert np.array_equal(dequantize(qt), gguf.quants.dequantize(raw, TYPES[kind]))
        assert np.array_equal(to_gguf_bytes(qt), raw)

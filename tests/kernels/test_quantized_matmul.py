"""Weight-only quantized matmul (`pallas_kernels.stacked_matmul.quantized`): every format through the C++ kernel,
XLA on the packed arrays and the unpacked reference, against a float64 oracle on random weights (no weight zero);
dequantization bit for bit against the formulas; the embedding lookup; the reference path partitioned over a
2-device mesh along N and along K."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.stacked_matmul import quantized as qm

FORMATS = sorted(qm.FORMATS)
ROWS = (1, 2, 3, 5, 8, 17, 64)  # the kernel: every regime and tile remainder; XLA's paths a few of them
XLA_ROWS = (1, 5, 17)
# (L, K, *N): N of several panels (one as two axes), K of several groups
SHAPES = ((3, 96, 64), (3, 64, 3, 32), (2, 160, 96))
LAYER = 1
needs_kernel = pytest.mark.skipif(not qm.available(), reason="the CPU kernel did not build")


def poisoned(qw: qm.QuantizedWeight, layer: int) -> qm.QuantizedWeight:
    """`qw` with NaN scales in every layer but `layer`: a path reading another layer fails."""
    nan = np.full_like(qw.scales, np.nan)
    nan[layer] = qw.scales[layer]
    return qw._replace(scales=nan)


def x_rows(rng, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """x with NaN in the rows not compared (every third from the second): (x, mask of the compared rows)."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    keep = np.ones(rows, bool)
    if rows > 1:
        keep[1::3] = False
    x[~keep] = np.nan
    return x, keep


def check(got, x, keep, qw, layer):
    """`got` against the oracle on the compared rows: within 1e-5 of sum |x| |w| (float32 accumulation)."""
    got = np.asarray(got, np.float64)
    ref = qm.reference_matmul(x[keep], qw, layer)
    w = np.abs(qm._dequant_numpy(qw, layer)).reshape(x.shape[1], -1)
    bound = (1e-5 * (np.abs(x[keep]).astype(np.float64) @ w) + 1e-30).reshape(ref.shape)
    assert got.shape == (x.shape[0], *ref.shape[1:])
    assert np.isfinite(got[keep]).all(), "a NaN row of x leaked into another row"
    err = np.abs(got[keep] - ref) / bound
    assert err.max() <= 1, f"worst error {err.max():.3g} x the bound"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["kernel", "packed_xla", "reference"])
def test_matmul_matches_the_float64_oracle(fmt, backend):
    if backend == "kernel" and not qm.available():
        pytest.skip("the CPU kernel did not build")
    rng = np.random.default_rng(hash((fmt, backend)) % 2**32)
    for shape in SHAPES:
        qw = qm.random_weight(rng, fmt, shape)
        weight = poisoned(qw, LAYER)
        if backend == "reference":
            weight = jax.device_put(weight)
            fn = jax.jit(lambda x, w, i: qm.quantized_matmul(x, w, i, backend="reference"))
        else:
            weight = jax.device_put(qm.pack(weight))
            max_rows = None if backend == "kernel" else 0
            fn = jax.jit(
                lambda x, w, i, m=max_rows: qm.quantized_matmul(x, w, i, backend="cpu_packed", kernel_max_rows=m)
            )
        for rows in ROWS if backend == "kernel" else XLA_ROWS:
            x, keep = x_rows(rng, rows, shape[1])
            check(fn(x, weight, LAYER), x, keep, qw, LAYER)


@needs_kernel
def test_kernel_max_rows_hands_larger_row_counts_to_xla():
    rng = np.random.default_rng(1)
    qw = qm.random_weight(rng, "q4_1", (2, 64, 64))
    packed = qm.pack(qw)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    jaxpr = str(jax.make_jaxpr(lambda x: qm.quantized_matmul(x, packed, 0, backend="cpu_packed", kernel_max_rows=4))(x))
    assert qm.TARGET not in jaxpr
    jaxpr = str(jax.make_jaxpr(lambda x: qm.quantized_matmul(x, packed, 0, backend="cpu_packed", kernel_max_rows=5))(x))
    assert qm.TARGET in jaxpr


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_kernel_runs_each_tile_against_its_own_layer(fmt):
    """A mixture of experts' grouped matmul: tiles of rows in one call, each against its own layer (expert) of
    the stack; the layers no tile names have NaN scales, a tile's padding rows are NaN."""
    rng = np.random.default_rng(5)
    shape, index = (5, 96, 2, 32), np.array([3, 0, 0, 4], np.int32)
    qw = qm.random_weight(rng, fmt, shape)
    scales = np.full_like(qw.scales, np.nan)
    scales[index] = qw.scales[index]
    packed = jax.device_put(qm.pack(qw._replace(scales=scales)))
    for tile_rows in (1, 5, 17):
        for max_rows in (None, tile_rows - 1):  # the one kernel call; XLA tile by tile above kernel_max_rows
            tiles = []
            for layer in index:
                x, keep = x_rows(rng, tile_rows, shape[1])
                tiles.append((x, keep, layer))
            fn = jax.jit(lambda t, w, i, m=max_rows: qm.grouped_quantized_matmul(t, w, i, kernel_max_rows=m))
            got = fn(np.stack([t[0] for t in tiles]), packed, index)
            for (x, keep, layer), out in zip(tiles, np.asarray(got), strict=True):
                check(out, x, keep, qw, int(layer))


def as_int8_blocks(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """x with its compared rows as the integer path multiplies them: `quantize_rows`' int8 blocks, dequantized."""
    out = x.copy()
    out[keep] = qm.dequantize_rows(*qm.quantize_rows(x[keep]))
    return out


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_integer_path_matches_the_oracle_on_x_as_its_int8_blocks(fmt):
    """`int8_min_rows`: from that many rows on x is quantized to int8 blocks of 32 and multiplied by integer dot
    instructions (in the few-row regime too where the target arranges quads in registers).
    Against the float64 oracle on those blocks dequantized, within the float32 accumulation's 1e-5 (x's own
    quantization error is ~100x that, so the float-activation path fails this); a NaN row of x stays in its row,
    other layers' scales are NaN; the grouped call alike."""
    rng = np.random.default_rng(FORMATS.index(fmt))
    matmul = jax.jit(lambda x, w, i: qm.quantized_matmul(x, w, i, backend="cpu_packed", int8_min_rows=1))
    for shape in (*SHAPES, (2, 1056, 64)):  # K of 33 blocks: int_panels.h's spans of 16 blocks, and a remainder
        qw = qm.random_weight(rng, fmt, shape)
        weight = jax.device_put(qm.pack(poisoned(qw, LAYER)))
        few = qm.int8_few_rows()  # the few-row regime takes the integer path too
        for rows in (1, 2, 3, 4, 5, 8, 17, qm.INT_STREAM_ROWS, qm.INT_STREAM_ROWS + 1, 64) if few else (5, 8, 17, 64):
            x, keep = x_rows(rng, rows, shape[1])
            check(matmul(x, weight, LAYER), as_int8_blocks(x, keep), keep, qw, LAYER)
    grouped = jax.jit(lambda t, w, i: qm.grouped_quantized_matmul(t, w, i, int8_min_rows=5))
    index = np.array([2, 0, 0], np.int32)
    qw = qm.random_weight(rng, fmt, (3, 96, 64))
    tiles = [x_rows(rng, 6, 96) for _ in index]
    got = grouped(np.stack([x for x, _ in tiles]), jax.device_put(qm.pack(qw)), index)
    for (x, keep), out, layer in zip(tiles, np.asarray(got), index, strict=True):
        check(out, as_int8_blocks(x, keep), keep, qw, int(layer))


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_the_few_row_regime_takes_the_integer_path_only_where_quads_fit_registers(fmt):
    """Up to quant_panels.h's few-row regime (`STREAM_ROWS`) the integer path runs only where the target arranges
    quads in registers (`int8_few_rows`: AVX512-VBMI, NEON, SSE); elsewhere (AVX2) those rows keep the
    float-activation code whatever `int8_min_rows` says, bit for bit."""
    rng = np.random.default_rng(7)
    packed = jax.device_put(qm.pack(qm.random_weight(rng, fmt, (1, 96, 64))))
    for rows in range(1, qm.STREAM_ROWS + 1):
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        plain, integer = (np.asarray(qm.quantized_matmul_cpu(x, packed, 0, int8_min_rows=m)) for m in (0, 1))
        assert np.array_equal(plain, integer) != qm.int8_few_rows()


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_the_integer_paths_few_rows_score_a_row_as_it_scores_alone(fmt):
    """Up to `INT_STREAM_ROWS` rows, where the few rows have an integer path, a row's result is bit for bit the
    one it gets alone: a step verifying drafts scores its rows as one-row steps do, so greedy speculation does not
    change the text (-ffast-math had factored an 8-bit term differently for one row than for more)."""
    if not qm.int8_few_rows():
        pytest.skip("this target's few rows keep float activations")
    rng = np.random.default_rng(11)
    packed = jax.device_put(qm.pack(qm.random_weight(rng, fmt, (1, 576, 256))))
    x = rng.standard_normal((qm.INT_STREAM_ROWS, 576)).astype(np.float32)
    alone = np.asarray(qm.quantized_matmul_cpu(x[:1], packed, 0, int8_min_rows=1))
    for rows in (2, 4, 5, 8, qm.INT_STREAM_ROWS):
        assert np.array_equal(np.asarray(qm.quantized_matmul_cpu(x[:rows], packed, 0, int8_min_rows=1))[:1], alone)


def test_quantize_rows_is_llama_cpps_q8_1():
    """Each block of 32: scale max|x| / 127, q = round-half-to-even(x * 127 / max|x|) in [-127, 127]; a zero
    block stays zero."""
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.linspace(-2, 2, 32, dtype=np.float32)
    x[0, 32:36] = [63.5, 1.25, 1.75, -0.25]  # scale 0.5: 127, 2.5, 3.5 and -0.5 steps
    q, scales = qm.quantize_rows(x)
    assert scales[0, 0] == np.float32(2) / np.float32(127) and (q[0, 0], q[0, 31]) == (-127, 127)
    assert scales[0, 1] == np.float32(0.5) and list(q[0, 32:36]) == [127, 2, 4, 0]
    assert not q[1].any() and not scales[1].any()
    np.testing.assert_allclose(qm.dequantize_rows(q, scales), x, atol=float(scales.max()) / 2 + 1e-6)


def numpy_dequant32(qw: qm.QuantizedWeight, layer: int) -> np.ndarray:
    """The formulas in float32 numpy, each operation rounded once: `d * q`, `d * q + m`, `d * (q - 8)`."""
    qs, d = np.asarray(qw.qs[layer]), np.asarray(qw.scales[layer]).astype(np.float32)
    if qs.dtype == np.uint8:
        b = qs.reshape(qs.shape[0] // 16, 1, 16, *qs.shape[1:])
        q = np.concatenate([b & 15, b >> 4], axis=1).reshape(qs.shape[0] * 2, *qs.shape[1:]).astype(np.float32)
    else:
        q = qs.astype(np.float32)
    group = q.shape[0] // d.shape[0]
    d = np.repeat(d, group, axis=0)
    if qw.mins is not None:
        return d * q + np.repeat(np.asarray(qw.mins[layer]).astype(np.float32), group, axis=0)
    return d * (q - np.float32(8)) if qs.dtype == np.uint8 else d * q


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_the_formulas_bit_for_bit(fmt):
    rng = np.random.default_rng(2)
    shape = (3, 96, 2, 32)
    qw = qm.random_weight(rng, fmt, shape)
    want = numpy_dequant32(qw, LAYER)
    assert want.shape == shape[1:] and (want != 0).all()
    for packed, weight in ((False, qw), (True, qm.pack(qw))):
        got = jax.jit(lambda w, i, p=packed: qm.dequantize(w, i, packed=p))(jax.device_put(weight), LAYER)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"packed={packed}")
    bf16 = qm.dequantize(qw, LAYER, packed=False, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16), want.astype(jnp.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_rows_are_the_embedding_rows(fmt):
    rng = np.random.default_rng(3)
    qw = qm.random_weight(rng, fmt, (1, 64, 96))  # E.T of a 96-token embedding
    table = numpy_dequant32(qw, 0).T  # E [V, K]
    index = np.array([0, 95, 31, 32, 64, 7, 7], np.int32)
    for packed, weight in ((False, qw), (True, qm.pack(qw))):
        got = jax.jit(lambda w, i, p=packed: qm.quantized_rows(w, i, packed=p))(jax.device_put(weight), index)
        np.testing.assert_array_equal(np.asarray(got), table[index], err_msg=f"packed={packed}")


def test_pack_and_packable():
    rng = np.random.default_rng(4)
    qw = qm.random_weight(rng, "q4_1", (2, 64, 64))
    packed = qm.pack(qw)
    assert packed.mins is not None and qw.mins is not None
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(packed[:2], qw[:2], strict=True))
    # panel p of layer l: its 32 columns of every row, contiguous
    np.testing.assert_array_equal(packed.qs[1].reshape(2, 32, 32)[1], qw.qs[1][:, 32:])
    np.testing.assert_array_equal(packed.mins[1].reshape(2, 2, 32)[0], qw.mins[1][:, :32])
    assert not qm.packable(qm.random_weight(rng, "q8_0", (1, 64, 48)))  # N not whole panels
    with pytest.raises(ValueError, match="mins"):
        qm.quantized_matmul(
            jnp.ones((1, 64), jnp.float32), qw._replace(qs=qw.qs.view(np.int8).repeat(2, 1)), 0, backend="reference"
        )
    for fmt, f in qm.FORMATS.items():
        w = qm.random_weight(rng, fmt, (1, 64, 32))
        assert w.qs.dtype == (np.int8 if f.bits == 8 else np.uint8) and (w.mins is not None) == f.has_min
        assert w.scales.shape[1] == 64 // (f.group or 64)
        assert (qm._dequant_numpy(w, 0) != 0).all()


@pytest.mark.parametrize("fmt", ["q4_1", "int8", "q4_0"])
def test_reference_partitions_along_n_and_along_k(fmt):
    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip("needs two devices (conftest.py sets --xla_force_host_platform_device_count)")
    mesh = Mesh(np.array(devices), ("tp",))
    rng = np.random.default_rng(5)
    qw = qm.random_weight(rng, fmt, (2, 128, 64))
    x = rng.standard_normal((3, 128)).astype(np.float32)
    want = qm.reference_matmul(x, qw, LAYER)
    fn = jax.jit(lambda x, w, i: qm.quantized_matmul(x, w, i, backend="reference"))
    column = P(None, None, "tp")  # column-parallel: every array split along N
    per_channel = qw.scales.shape[1] == 1  # int8: one scale per column, not split along K
    row = P(None, "tp", None)  # row-parallel: split along K (x too)
    for spec, scale_spec, x_spec in ((column, column, P()), (row, P() if per_channel else row, P(None, "tp"))):
        put = [
            jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(qw, (spec, scale_spec, scale_spec), strict=False)
        ]
        weight = qm.QuantizedWeight(put[0], put[1], None if qw.mins is None else put[2])
        got = fn(jax.device_put(x, NamedSharding(mesh, x_spec)), weight, LAYER)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
        if spec is column:
            assert got.sharding.spec == P(None, "tp"), got.sharding  # partitioned like an ordinary dot

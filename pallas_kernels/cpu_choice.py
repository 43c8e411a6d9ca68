"""Which C++ CPU kernels a step runs on this machine: a short self-check against XLA, cached per machine.

The kernels are compiled for one target (`cpu_ffi.march()`); a CPU, or a target, where they lose to
XLA's own path on some shapes must not run them there. `choose` times, on the model's own shapes:
- the stacked matmul kernel against XLA's dot on the same packed weights
  (`stacked_matmul.stacked_matmul_packed_xla`, so either choice reads one copy of the weights), each
  projection of a layer one after another, at a few row counts (decode rows, a prefill chunk); a projection
  kept quantized (`(K, N, fmt)`, `stacked_matmul.quantized.FORMATS`) on random packed quants of its format, the kernel
  against XLA's dequantize-and-dot on them (`quantized.quantized_matmul_packed_xla`). The kernel serves every
  row count up to the last one from which on it stops winning (`matmul_max_rows`; None: all of them).
- the attention kernel (with its KV write) against the jnp reference on a decode batch and a
  prefill chunk, kept where it is the faster in total.
- for quantized projections, the kernel's integer path too (x quantized to int8 blocks, integer dot instructions:
  `stacked_matmul/int_panels.h`) against its float-activation path, from the fewest rows from which on it wins
  at every timed row count (`int8_min_rows`; 0: never), when `JAXLLM_CPU_INT8_DOT=auto` asks for it ("on": from
  the first row, untimed; "off", the default: the exact float-activation path; under JAXLLM_CPU_KERNELS=on, which
  times nothing, auto is off too).
It costs a few seconds once (logged when it starts, a bar per case while the engine's progress is on:
`pallas_kernels.progress`): the decision is stored beside the kernels, keyed by the kernel
libraries (source, flags, target, CPU, jaxlib), the shapes and XLA_FLAGS. `JAXLLM_CPU_KERNELS`
overrides it: "on" (the kernels wherever they apply, no timing), "off" (XLA only), "auto" (default).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi, progress, stacked_matmul
from pallas_kernels.ragged_paged_attention import cpu as attention_cpu
from pallas_kernels.stacked_matmul import quantized

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
FORMAT = 7  # bump when the timed cases or the decision rule change: stored decisions are then retaken
MAX_WEIGHT_ELEMENTS = 8 << 20  # a larger projection is timed on its first columns (the ratio is what counts)
COLD_BYTES = 64 << 20  # written before each timed call of a few rows: more than a server CPU's last-level cache


def mode() -> str:
    """`$JAXLLM_CPU_KERNELS`: "auto" (default), "on" or "off"."""
    value = os.environ.get("JAXLLM_CPU_KERNELS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"JAXLLM_CPU_KERNELS must be one of {MODES}, got {value!r}")
    return value


def int8_mode() -> str:
    """`$JAXLLM_CPU_INT8_DOT`: "off" (default: 8-bit activations flip this model's near-ties, the README's own
    question among them), "auto" or "on"."""
    value = os.environ.get("JAXLLM_CPU_INT8_DOT", "off").strip().lower() or "off"
    if value not in MODES:
        raise ValueError(f"JAXLLM_CPU_INT8_DOT must be one of {MODES}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """`matmul`: the stacked matmul kernel serves the step's projections, for x of at most
    `matmul_max_rows` rows (None: every row count; above it XLA's dot on the packed weights).
    `attention`: the C++ attention kernel and KV write, else the jnp reference. `int8_min_rows`: quantized
    projections of at least this many rows run the integer path (0: never)."""

    matmul: bool
    matmul_max_rows: int | None
    attention: bool
    mode: str
    target: str  # what the kernels were compiled for: "AVX2+FMA (-march=native)"
    timings_ms: dict = dataclasses.field(default_factory=dict, compare=False)
    int8_min_rows: int = 0

    def describe(self) -> str:
        if not self.matmul:
            matmul = "off"
        elif self.matmul_max_rows is None:
            matmul = "on"
        else:
            matmul = f"on for rows <= {self.matmul_max_rows}"
        if self.matmul and self.int8_min_rows:
            matmul += f", int8 dot from {self.int8_min_rows} row{'s' if self.int8_min_rows > 1 else ''}"
        attention = "on" if self.attention else "off"
        return f"CPU kernels ({self.mode}): matmul {matmul}, attention {attention}; {self.target}"


def _best_ms(fns, *args, reps: int = 5, cold: bool = False) -> tuple[float, ...]:
    """Each path's best time (ms) over `reps` calls, the paths called in turn. The minimum, because other work on
    the machine only ever adds time; in turn, so that a busy spell slows all alike. (Medians of one's calls, then
    the other's, had recorded XLA as faster for 512-row quantized chunks under a load of 6, a decision then cached
    for good: B=64 Q4_1 14 % below float32.) `cold`: the caches flushed before each call (untimed), as a step's
    layers find their weights: a few rows are bound by reading them from memory, and timed warm the integer path
    lost at one row where it wins in the model (the default model's Q4_1 chain, 1 row: 3.9 vs 4.2 ms)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))  # compile and warm
    flush = np.ones(COLD_BYTES // 8) if cold else None
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if flush is not None:
                flush += 1.0
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - start)
    return tuple(t * 1e3 for t in best)


def _time_matmuls(shapes, dtype, row_counts, rng, bar=None, int8=False) -> dict[int, tuple[float, ...]]:
    """Per row count: (kernel ms, XLA ms) for one x @ W of every shape: `(K, N)` in `dtype`, `(K, N, fmt)` quantized;
    `int8`: and the kernel's ms with its integer path for the quantized shapes, at the row counts where that path
    exists (`quantized.int8_few_rows` says whether the few-row regime has it). `bar` (a tqdm bar, or None) advances
    by one per row count."""
    weights = []
    for k, n, *fmt in shapes:
        n = max(stacked_matmul.PANEL, min(n, MAX_WEIGHT_ELEMENTS // k // stacked_matmul.PANEL * stacked_matmul.PANEL))
        if fmt:
            weights.append(jax.device_put(quantized.pack(quantized.random_weight(rng, fmt[0], (1, k, n)))))
            continue
        w = rng.standard_normal((1, k, n), np.float32).astype(jnp.dtype(dtype))
        weights.append(jnp.asarray(stacked_matmul.pack(w)))

    def one(x, w, path: str):
        if isinstance(w, quantized.QuantizedWeight):
            x = x.astype(jnp.float32)  # quantized weights multiply float32 activations
            if path == "xla":
                return quantized.quantized_matmul_packed_xla(x, w, 0)
            return quantized.quantized_matmul_cpu(x, w, 0, int8_min_rows=int(path == "int8"))
        if path == "xla":
            return stacked_matmul.stacked_matmul_packed_xla(x, w, 0)
        return stacked_matmul.stacked_matmul_cpu(x, w, 0, packed=True)

    def chain(xs, ws, *, path):
        out: list = []
        for x, w in zip(xs, ws, strict=True):
            if out:  # after the previous one, as a layer's projections run: XLA would overlap independent calls
                x = x + 0 * out[-1][0, 0].astype(x.dtype)
            out.append(one(x, w, path))
        return out

    paths = [jax.jit(functools.partial(chain, path=path)) for path in ("kernel", "xla", "int8")]
    out = {}
    for rows in row_counts:
        xs = [jnp.asarray(rng.standard_normal((rows, shape[0]), np.float32), dtype) for shape in shapes]
        timed = int8 and (rows > quantized.STREAM_ROWS or quantized.int8_few_rows())  # else the same code either way
        cold = rows <= quantized.STREAM_ROWS
        out[rows] = _best_ms(paths if timed else paths[:2], xs, weights, cold=cold)
        if bar is not None:
            bar.update()
    return out


def _time_attention(shape: AttentionShape, chunk: int, rng, bar=None) -> dict[str, tuple[float, ...]]:
    """(kernel ms, reference ms) on a decode batch (8 rows, 512 keys each) and a prefill chunk; `bar` (a tqdm bar,
    or None) advances by one per case."""
    from pallas_kernels import ragged_paged_attention, write_kv
    from pallas_kernels.ragged_paged_attention.testing import make_batch

    def step(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, slots, *, backend):
        new = q[:, : shape.kv_heads].astype(jnp.float32)  # rows to write: any values of the right shape
        k_cache, v_cache = write_kv(k_cache, v_cache, new, new, slots, backend=backend)
        args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
        return ragged_paged_attention(*args, sm_scale=shape.head_dim**-0.5, backend=backend)

    out = {}
    cases = {"decode": ([1] * 8, [512] * 8), "prefill": ([chunk], [chunk])}
    for name, (q_lens, kv_lens) in cases.items():
        b = make_batch(
            rng,
            q_lens,
            kv_lens,
            num_q_heads=shape.q_heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            block_size=shape.block_size,
            dtype=jnp.dtype(shape.kv_dtype),
            hostile=False,
        )
        args = (b.q.astype(np.float32), *b.args()[1:], np.arange(len(b.q), dtype=np.int32))
        kernel = jax.jit(functools.partial(step, backend="cpu"))
        reference = jax.jit(functools.partial(step, backend="reference"))
        out[name] = _best_ms((kernel, reference), *args)
        if bar is not None:
            bar.update()
    return out


def _stored(key: str) -> dict | None:
    try:
        return json.loads((cpu_ffi.cache_dir() / "choices" / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def _store(key: str, record: dict) -> None:
    path = cpu_ffi.cache_dir() / "choices" / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: the choice is retaken next start
        logger.warning("could not store the CPU kernel choice: %s", e)


MatmulShape = tuple[int, int] | tuple[int, int, str]


def choose(
    matmul_shapes: tuple[MatmulShape, ...], dtype: str, max_rows: int, attention: AttentionShape | None
) -> KernelChoice:
    """The kernels a step of these shapes runs: `matmul_shapes` (K, N) of a layer's packed projections in
    `dtype` ("float32" or "bfloat16"), or (K, N, fmt) for one kept quantized in `fmt` (a key of
    `stacked_matmul.quantized.FORMATS`), up to `max_rows` rows of x; `attention`: the model's heads and cache
    (None: no attention kernel wanted). Self-checked under "auto" (see the module's docstring)."""
    return _choose(matmul_shapes, dtype, max_rows, attention, mode(), int8_mode())


def _int8_min_rows(matmul: dict) -> int:
    """The fewest timed rows from which on the integer path won at every timed row count (0: it lost the last)."""
    start = 0
    for rows in sorted((int(r) for r, t in matmul.items() if len(t) > 2), reverse=True):
        kernel, _, int8 = matmul[str(rows)]
        if int8 > kernel:
            break
        start = rows
    return start


@functools.cache
def _choose(
    matmul_shapes: tuple[MatmulShape, ...],
    dtype: str,
    max_rows: int,
    attention: AttentionShape | None,
    how: str,
    int8_how: str = "auto",
) -> KernelChoice:
    # a cold start compiles both kernels side by side (~5-10 s each), not one after the other in `available`
    wanted = ((stacked_matmul.SOURCE, bool(matmul_shapes)), (attention_cpu.SOURCE, attention is not None))
    cpu_ffi.prebuild(*(source for source, want in wanted if want))
    target = f"{cpu_ffi.isa()} (-march={cpu_ffi.march()})"
    matmul_ok = bool(matmul_shapes) and stacked_matmul.available()
    if any(len(shape) > 2 for shape in matmul_shapes):
        matmul_ok = matmul_ok and quantized.available()
    attention_ok = attention is not None and attention_cpu.available()
    quantized_shapes = any(len(shape) > 2 for shape in matmul_shapes)
    forced_int8 = 1 if int8_how == "on" and quantized_shapes else 0
    if how != "auto" or not (matmul_ok or attention_ok):
        on = how != "off"
        return KernelChoice(matmul_ok and on, None, attention_ok and on, how, target, int8_min_rows=forced_int8)
    # decode rows, and prefill chunks densely enough that the hand-over to XLA lands near the real crossover (a
    # quantized layer: XLA dequantizes it whole per step, which pays only for hundreds of rows)
    row_counts = sorted({r for r in (1, 8, 64, 128, 256, max_rows) if r <= max_rows})
    time_int8 = quantized_shapes and int8_how == "auto"
    if time_int8 and quantized.int8_few_rows():  # a verification of drafts, a few sequences: the integer
        row_counts = sorted({*row_counts, min(quantized.STREAM_ROWS, max_rows)})  # path's lead grows with rows
    built = ((stacked_matmul.SOURCE, matmul_ok), (attention_cpu.SOURCE, attention_ok))
    libs = [cpu_ffi.library(source).name if ok else None for source, ok in built]  # each keyed by source and target
    parts = [FORMAT, libs, matmul_shapes, dtype, row_counts, dataclasses.astuple(attention) if attention else None]
    parts.append(time_int8)
    parts += [os.environ.get("XLA_FLAGS", ""), jax.__version__, os.cpu_count()]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    record = _stored(key)
    if record is None:
        started = time.perf_counter()
        rng = np.random.default_rng(0)
        cases = (len(row_counts) if matmul_ok else 0) + (2 if attention_ok and attention else 0)
        logger.info(
            "checking the CPU kernels against XLA on this model's shapes (%d cases): first use on this machine, "
            "a few seconds",
            cases,
        )
        with progress.bar(cases, "CPU kernel self-check", "case") as bar:
            matmul = _time_matmuls(matmul_shapes, dtype, row_counts, rng, bar, time_int8) if matmul_ok else {}
            attn = _time_attention(attention, min(max_rows, 256), rng, bar) if attention_ok and attention else {}
        record = {"matmul": {str(r): t for r, t in matmul.items()}, "attention": attn}
        record["seconds"] = round(time.perf_counter() - started, 2)
        _store(key, record)
        logger.info("CPU kernel self-check took %.1fs", record["seconds"])
    int8_min_rows = _int8_min_rows(record["matmul"]) if time_int8 else forced_int8

    def kernel_ms(rows: str, times) -> float:  # the path the kernel takes at this row count
        return times[2] if int8_min_rows and len(times) > 2 and int(rows) >= int8_min_rows else times[0]

    wins = [int(r) for r, t in record["matmul"].items() if kernel_ms(r, t) <= t[1]]
    losses = [int(r) for r, t in record["matmul"].items() if kernel_ms(r, t) > t[1]]
    max_kernel_rows = None if not losses else max((r for r in wins if r < min(losses)), default=0)
    attn_times = record["attention"].values()
    attention_on = attention_ok and sum(k for k, _ in attn_times) <= sum(r for _, r in attn_times)
    timings = {"matmul": record["matmul"], "attention": record["attention"]}
    matmul_on = matmul_ok and max_kernel_rows != 0
    int8_min_rows = int8_min_rows if matmul_on else 0
    return KernelChoice(matmul_on, max_kernel_rows, attention_on, how, target, timings, int8_min_rows)

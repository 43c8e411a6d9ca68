#!/usr/bin/env python
"""The default model's matmuls with quantized weights: the C++ kernel vs XLA's dequantize-and-dot.

A decode step's matmul chain of SmolLM2-135M (30 layers of qkv, o, gate-up and down in a `lax.scan`,
weights stacked `[L, ...]` and packed, then the tied LM head `[rows, 576] @ E.T`, E `[49152, 576]`),
per weight format: "float32" (the float32 packed kernel, today's path), and each quantized format of
`pallas_kernels.stacked_matmul.quantized` for the layers with the head in q8_0 (as the default model's
GGUF file stores it; float32 for the float32 row). Each through the kernel ("cpu_packed") and through
XLA on the same packed arrays (`kernel_max_rows=0`). Variants alternate over `--calls` calls; reports
the median and minimum wall ms per chain and the weight bytes read per chain over the median (GB/s), and
writes JSON with the machine's load average.

    python benchmarks/quantized_matmul.py --rows 1 8 64 --output benchmarks/results/quantized_matmul_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi
from pallas_kernels import stacked_matmul as sm
from pallas_kernels.stacked_matmul import quantized as qm

LAYERS, HIDDEN, INNER, VOCAB = 30, 576, 1536, 49152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * INNER), (INNER, HIDDEN)]
HEAD_FORMAT = "q8_0"


def fast_weight(rng, fmt: str, shape) -> qm.QuantizedWeight:
    """Random packed quants of `fmt` (random bytes: the values do not matter here, only the bytes read)."""
    f = qm.FORMATS[fmt]
    num_layers, k, n = shape
    groups = k // (f.group or k)
    scales = (rng.uniform(0.5, 1.5, (num_layers, groups, n)) * 0.01).astype(np.float16)
    if f.bits == 8:
        qs = rng.integers(-127, 128, shape, dtype=np.int8)
    else:
        qs = rng.integers(0, 256, (num_layers, k // 2, n), dtype=np.uint8)
    mins = (-8 * scales).astype(np.float16) if f.has_min else None
    return qm.pack(qm.QuantizedWeight(qs, scales, mins))


def nbytes(w) -> int:
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(w))


def chain(matmul, head):
    def layer(h, i, ws):
        q = matmul(h, ws[0], i)[:, :HIDDEN]
        h = h + matmul(q, ws[1], i)
        g = matmul(h, ws[2], i)
        return (h + matmul(g[:, :INNER] * jax.nn.silu(g[:, INNER:]), ws[3], i)) * 0.5

    def run(x, ws, e):
        h = jax.lax.scan(lambda h, i: (layer(h, i, ws), None), x, jnp.arange(LAYERS))[0]
        return head(h, e)

    return jax.jit(run)


def variants(rng, formats):
    """{name: (jitted chain, weights, head weight, bytes per chain)}."""
    out = {}
    ws32 = [sm.pack(rng.standard_normal((LAYERS, *s), np.float32) * 0.02) for s in SHAPES]
    e32 = sm.pack(rng.standard_normal((1, HIDDEN, VOCAB), np.float32) * 0.02)
    ws32, e32 = jax.device_put((ws32, e32))
    size = nbytes(ws32) + nbytes(e32)
    for name, max_rows in (("kernel", None), ("xla", 0)):
        out[f"float32/{name}"] = (
            chain(
                lambda x, w, i, m=max_rows: sm.stacked_matmul(x, w, i, backend="cpu_packed", kernel_max_rows=m),
                lambda h, e, m=max_rows: sm.stacked_matmul(h, e, 0, backend="cpu_packed", kernel_max_rows=m),
            ),
            ws32,
            e32,
            size,
        )
    del ws32, e32
    head = jax.device_put(fast_weight(rng, HEAD_FORMAT, (1, HIDDEN, VOCAB)))
    for fmt in formats:
        ws = jax.device_put([fast_weight(rng, fmt, (LAYERS, *s)) for s in SHAPES])
        size = nbytes(ws) + nbytes(head)
        for name, max_rows in (("kernel", None), ("xla", 0)):

            def mm(x, w, i, m=max_rows):
                return qm.quantized_matmul(x, w, i, backend="cpu_packed", kernel_max_rows=m)

            out[f"{fmt}/{name}"] = (chain(mm, lambda h, e, mm=mm: mm(h, e, 0)), ws, head, size)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--formats", nargs="+", default=["q4_1", "q8_0", "int8", "int4"])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    cases = variants(rng, args.formats)
    results: dict = {
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "target": f"{cpu_ffi.isa()} (-march={cpu_ffi.march()})",
        "cpus": os.cpu_count(),
        "what": f"30-layer matmul chain + LM head ({HEAD_FORMAT} head for quantized formats)",
        "mbytes_per_chain": {name.split("/")[0]: round(size / 1e6, 1) for name, (*_, size) in cases.items()},
        "rows": {},
    }
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), np.float32))
        times: dict[str, list[float]] = {name: [] for name in cases}
        for f, ws, e, _ in cases.values():
            f(x, ws, e).block_until_ready()  # compile
        for _ in range(args.calls):
            for name, (f, ws, e, _) in cases.items():
                start = time.perf_counter()
                f(x, ws, e).block_until_ready()
                times[name].append(time.perf_counter() - start)
        summary = {}
        for name, t in times.items():
            median = statistics.median(t)
            summary[name] = {
                "median_ms": round(median * 1e3, 2),
                "min_ms": round(min(t) * 1e3, 2),
                "gb_per_s": round(cases[name][3] / median / 1e9, 1),
            }
        results["rows"][rows] = summary
        print(rows, json.dumps(summary), flush=True)
    results["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

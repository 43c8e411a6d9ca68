#!/usr/bin/env python
"""The scanned model's matmul chain at decode rows: the C++ stacked matmul vs XLA's dot on a slice.

30 layers of the default model's projection shapes (qkv, o, gate-up, down) in a `lax.scan`,
weights stacked `[L, ...]`; each variant alternated over `--calls` calls. Reports the minimum and
median of wall and process CPU time per chain (CPU time is steadier on a shared machine) and
writes JSON. `benchmarks/NOTES.md`, lever 7, quotes it.

    python benchmarks/stacked_matmul_bench.py --rows 1 4 8 16 --output benchmarks/results/stacked_matmul_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.stacked_matmul import stacked_matmul_cpu, stacked_matmul_reference

LAYERS, HIDDEN, INNER = 30, 576, 1536
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * INNER), (INNER, HIDDEN)]


def chain(matmul):
    def layer(h, i, ws):
        q = matmul(h, ws[0], i)[:, :HIDDEN]
        h = h + matmul(q, ws[1], i)
        g = matmul(h, ws[2], i)
        return (h + matmul(g[:, :INNER] * jax.nn.silu(g[:, INNER:]), ws[3], i)) * 0.5

    return jax.jit(lambda x, ws: jax.lax.scan(lambda h, i: (layer(h, i, ws), None), x, jnp.arange(LAYERS))[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (LAYERS, *s), jnp.float32) * 0.02 for i, s in enumerate(SHAPES)]
    variants = {"cpu_kernel": chain(stacked_matmul_cpu), "xla_slice_dot": chain(stacked_matmul_reference)}
    results = {"load_average": os.getloadavg(), "rows": {}}
    for rows in args.rows:
        x = jax.random.normal(key, (rows, HIDDEN), jnp.float32)
        times = {name: {"wall": [], "cpu": []} for name in variants}
        for f in variants.values():
            f(x, ws).block_until_ready()  # compile
        for _ in range(args.calls):
            for name, f in variants.items():
                wall, cpu = time.perf_counter(), time.process_time()
                f(x, ws).block_until_ready()
                times[name]["wall"].append(time.perf_counter() - wall)
                times[name]["cpu"].append(time.process_time() - cpu)
        summary = {name: {f"{k}_{stat}_ms": round(fn(v) * 1e3, 2) for k, v in t.items()
                          for stat, fn in (("min", min), ("median", statistics.median))} for name, t in times.items()}
        summary["cpu_min_ratio_xla_over_kernel"] = round(summary["xla_slice_dot"]["cpu_min_ms"]
                                                         / summary["cpu_kernel"]["cpu_min_ms"], 2)
        results["rows"][rows] = summary
        print(rows, json.dumps(summary))
    results["load_average_end"] = os.getloadavg()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The default model's matmuls at decode rows: jaxllm's C++ kernel vs XLA's dot.

- chain: 30 layers of the projection shapes (qkv, o, gate-up, down) in a `lax.scan`, weights
  stacked `[L, ...]`: the kernel reading its layer in place vs XLA's dot on a slice
  (`benchmarks/NOTES.md`, lever 7);
- head (`--head`): the tied LM head, `[rows, 576] @ E.T` with E `[49152, 576]`: XLA's dot on E
  vs the kernel on E packed (lever 12).

Variants alternate over `--calls` calls. Reports the minimum and median of wall and process CPU
time per call (CPU time is steadier on a shared machine) and writes JSON.

    python benchmarks/stacked_matmul_bench.py --rows 1 4 8 16 --output benchmarks/results/stacked_matmul_cpu.json
    python benchmarks/stacked_matmul_bench.py --head --rows 1 64 256 --output benchmarks/results/lm_head_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.stacked_matmul import pack_matrix, packed_matmul, stacked_matmul_cpu, stacked_matmul_reference

LAYERS, HIDDEN, INNER, VOCAB = 30, 576, 1536, 49152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * INNER), (INNER, HIDDEN)]


def chain(matmul):
    def layer(h, i, ws):
        q = matmul(h, ws[0], i)[:, :HIDDEN]
        h = h + matmul(q, ws[1], i)
        g = matmul(h, ws[2], i)
        return (h + matmul(g[:, :INNER] * jax.nn.silu(g[:, INNER:]), ws[3], i)) * 0.5

    return jax.jit(lambda x, ws: jax.lax.scan(lambda h, i: (layer(h, i, ws), None), x, jnp.arange(LAYERS))[0])


def time_variants(variants: dict, calls: int) -> dict:
    """{name: (jitted fn, args)} → min and median wall and CPU ms of each, calls alternated."""
    times = {name: {"wall": [], "cpu": []} for name in variants}
    for f, f_args in variants.values():
        f(*f_args).block_until_ready()  # compile
    for _ in range(calls):
        for name, (f, f_args) in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            f(*f_args).block_until_ready()
            times[name]["wall"].append(time.perf_counter() - wall)
            times[name]["cpu"].append(time.process_time() - cpu)
    return {
        name: {
            f"{k}_{stat}_ms": round(fn(v) * 1e3, 2)
            for k, v in t.items()
            for stat, fn in (("min", min), ("median", statistics.median))
        }
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--output", default=None)
    parser.add_argument("--head", action="store_true", help="time the tied LM head instead of the chain")
    args = parser.parse_args()
    key = jax.random.key(0)
    if args.head:
        embedding = jax.random.normal(key, (VOCAB, HIDDEN), jnp.float32) * 0.02
        weights = {
            "xla_dot": (jax.jit(lambda x, e: (e @ x.T).T), embedding),
            "cpu_kernel_packed": (jax.jit(packed_matmul), pack_matrix(embedding, transposed=True)),
        }
    else:
        ws = [
            jax.random.normal(jax.random.fold_in(key, i), (LAYERS, *s), jnp.float32) * 0.02
            for i, s in enumerate(SHAPES)
        ]
        weights = {
            "xla_slice_dot": (chain(stacked_matmul_reference), ws),
            "cpu_kernel": (chain(stacked_matmul_cpu), ws),
        }
    results = {"load_average": os.getloadavg(), "what": "lm_head" if args.head else "chain", "rows": {}}
    for rows in args.rows:
        x = jax.random.normal(key, (rows, HIDDEN), jnp.float32)
        summary = time_variants({name: (f, (x, w)) for name, (f, w) in weights.items()}, args.calls)
        xla, kernel = summary  # dicts keep insertion order: XLA first
        summary["cpu_min_ratio_xla_over_kernel"] = round(summary[xla]["cpu_min_ms"] / summary[kernel]["cpu_min_ms"], 2)
        results["rows"][rows] = summary
        print(rows, json.dumps(summary))
    results["load_average_end"] = os.getloadavg()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

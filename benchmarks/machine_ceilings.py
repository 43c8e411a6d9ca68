#!/usr/bin/env python
"""The machine's two roofline ceilings: large matmul FLOP/s, and memory read bandwidth.

Matmul: a jitted `[n, n] @ [n, n]` in float32 and bfloat16 under XLA, median of `--reps` runs,
and through jaxllm's own CPU kernel on packed weights (`pallas_kernels.stacked_matmul`,
"cpu_packed"), with the target it was built for (`kernel_target`) and its ratio to XLA's dot
(`matmul_{dtype}_kernel_over_xla`); `matmul_{dtype}_gflops`, the ceiling, is the faster. `matmul_int8_gflops`:
the quantized kernel's integer path (x in int8 blocks, integer dot instructions), the faster of an `[n, n]` Q8_0
and Q4_1 weight (`matmul_int8_{format}_gflops`: where `pmaddubsw` is the way, 8-bit quants take the sign trick and
4-bit ones sum in int16, so Q4_1 runs faster), the compute ceiling of engines that take it (multiply-adds counted
as 2 operations, as for the floats).
Instruction peaks (`isa_peak`, benchmarks/isa_peak.cc built with the kernels' compiler and -march, every core at
once): float32 FMAs and the integer path's int8 dot instruction a second with nothing but registers in the way, the
integer path's register tile with its per-block scaling in L1 (`isa_int8_tile_gops`), and each kernel ceiling as a
fraction of them (`matmul_float32_over_isa_peak`, `matmul_int8_over_isa_peak`, `matmul_int8_over_isa_tile`).
Memory: a jitted sum over a `--mem-mib` float32 array (reads every byte once, writes nothing),
and numpy's copy of the same array for comparison. Prints one JSON object.

    python benchmarks/machine_ceilings.py --n 2048 --reps 7 --mem-mib 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def int8_ceiling(n: int, reps: int) -> dict:
    """The quantized kernel's integer path on `[n, n] @ [n, n]` Q8_0 and Q4_1, and the faster as the ceiling
    (empty where the kernel did not build)."""
    import jax

    from pallas_kernels.stacked_matmul import quantized

    if not quantized.available():
        return {}
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.standard_normal((n, n), np.float32))
    kernel = jax.jit(lambda x, w: quantized.quantized_matmul_cpu(x, w, 0, int8_min_rows=1))
    out = {}
    for fmt in ("q8_0", "q4_1"):
        weight = jax.device_put(quantized.pack(quantized.random_weight(rng, fmt, (1, n, n))))
        seconds = median_seconds(lambda weight=weight: kernel(x, weight).block_until_ready(), reps)
        out[f"matmul_int8_{fmt}_gflops"] = round(2 * n**3 / seconds / 1e9, 1)
    return out | {"matmul_int8_gflops": max(out.values())}


def isa_peak(threads: int | None = None) -> dict:
    """benchmarks/isa_peak.cc's JSON on `threads` threads (default: every core), keys prefixed `isa_` (empty without
    a compiler or where it fails)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from pallas_kernels import cpu_ffi

    if not (compiler := cpu_ffi.find_compiler()):
        return {}
    source = Path(__file__).with_name("isa_peak.cc")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "isa_peak"
        build = [compiler, "-O2", f"-march={cpu_ffi.march()}", "-pthread", str(source), "-o", str(exe)]
        try:
            subprocess.run(build, check=True, capture_output=True)
            command = [str(exe), str(threads or os.cpu_count())]
            run = subprocess.run(command, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"isa_peak skipped: {e}")
            return {}
    return {f"isa_{k}": v for k, v in json.loads(run.stdout).items()}


def ceilings(n: int = 2048, reps: int = 7, mem_mib: int = 1024) -> dict:
    import jax
    import jax.numpy as jnp

    matmul = jax.jit(jnp.matmul)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    out = {"load_average": [round(x, 2) for x in os.getloadavg()]}
    for dtype in ("float32", "bfloat16"):
        x = a.astype(dtype)
        seconds = median_seconds(lambda x=x: matmul(x, x).block_until_ready(), reps)
        out[f"matmul_{dtype}_gflops"] = round(2 * n**3 / seconds / 1e9, 1)
        out[f"matmul_{dtype}_xla_gflops"] = out[f"matmul_{dtype}_gflops"]
    if jax.default_backend() == "cpu":
        from pallas_kernels import stacked_matmul

        if stacked_matmul.available():
            from pallas_kernels import cpu_ffi

            out["kernel_target"] = f"{cpu_ffi.isa()} (-march={cpu_ffi.march()})"
            kernel = jax.jit(lambda x, w: stacked_matmul.stacked_matmul(x, w, 0, backend="cpu_packed"))
            for dtype in ("float32", "bfloat16"):
                x = a.astype(dtype)
                packed = stacked_matmul.pack(x[None])
                seconds = median_seconds(lambda x=x, packed=packed: kernel(x, packed).block_until_ready(), reps)
                out[f"matmul_{dtype}_kernel_gflops"] = round(2 * n**3 / seconds / 1e9, 1)
                out[f"matmul_{dtype}_kernel_over_xla"] = round(
                    out[f"matmul_{dtype}_kernel_gflops"] / out[f"matmul_{dtype}_xla_gflops"], 2
                )
                out[f"matmul_{dtype}_gflops"] = max(out[f"matmul_{dtype}_gflops"], out[f"matmul_{dtype}_kernel_gflops"])
            out |= int8_ceiling(n, reps)
            out |= isa_peak()
            ratios = (
                ("matmul_float32_over_isa_peak", "matmul_float32_gflops", "isa_fma_float32_gflops"),
                ("matmul_int8_over_isa_peak", "matmul_int8_gflops", "isa_int8_dot_gops"),
                ("matmul_int8_over_isa_tile", "matmul_int8_q4_1_gflops", "isa_int8_tile_gops"),
            )
            out |= {name: round(out[a] / out[b], 2) for name, a, b in ratios if a in out and b in out}
    host = np.ones(mem_mib * 2**20 // 4, np.float32)
    device = jnp.asarray(host)
    total = jax.jit(jnp.sum)
    out["mem_read_gb_s"] = round(host.nbytes / median_seconds(lambda: total(device).block_until_ready(), reps) / 1e9, 1)
    copy = np.empty_like(host)
    out["numpy_copy_gb_s"] = round(host.nbytes / median_seconds(lambda: np.copyto(copy, host), reps) / 1e9, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mem-mib", type=int, default=1024)
    args = ap.parse_args()
    print(json.dumps(ceilings(args.n, args.reps, args.mem_mib)))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Ragged paged attention backends on decode and mixed batches: time and achieved bandwidth.

For every case and backend it prints one JSON line (and writes them all to --out):
median / min wall time over repetitions, the bytes of K and V the batch actually needs
(each real sequence's keys in its attention range, K and V, one layer), the bandwidth that
implies, and its fraction of the machine's copy bandwidth measured in the same run
(read + write bytes of a large on-device copy). Backends: "reference" (the jnp path the
CPU model runs), "dense" (naive: every row gathers its whole table and masks) and
"pallas" (the Pallas Triton kernel: compiled on a GPU; on CPU only with --interpret, which
times the interpreter and is meaningless as a speed figure).

Examples:
  python benchmarks/kernel_bench.py --suite cpu --out benchmarks/results/kernel_bench_cpu.json
  python benchmarks/kernel_bench.py --suite gpu --out "$OUT/kernel_bench_gpu.json"   # on a GPU
  python benchmarks/kernel_bench.py --suite smoke                                   # seconds, any machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.ragged_paged_attention.reference import (  # noqa: E402
    ragged_paged_attention_dense,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention.triton_gpu import ragged_paged_attention_triton  # noqa: E402


@dataclasses.dataclass
class Case:
    name: str
    q_lens: list[int]
    kv_lens: list[int]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_tokens: int  # token bucket T
    max_seqs: int  # sequence bucket S
    max_blocks: int  # table width (max_model_len / block_size)

    @property
    def kind(self) -> str:
        return "decode" if max(self.q_lens) == 1 else "mixed"

    def needed_bytes(self) -> int:
        keys = sum(self.kv_lens)
        return 2 * keys * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    def dense_gather_bytes(self) -> int:
        keys = self.num_tokens * self.max_blocks * self.block_size
        return 2 * keys * self.num_kv_heads * self.head_dim * 4


def build(case: Case, seed: int = 0):
    """Device arrays for a case: a cache holding exactly the needed blocks (+1 scratch)."""
    rng = np.random.default_rng(seed)
    b = case.block_size
    n_blocks = [-(-kl // b) for kl in case.kv_lens]
    num_blocks = sum(n_blocks) + 1
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((case.max_seqs, case.max_blocks), np.int32)
    cursor = 0
    for i, n in enumerate(n_blocks):
        tables[i, :n] = perm[cursor:cursor + n]
        cursor += n
    n = len(case.q_lens)
    cu = np.full(case.max_seqs + 1, sum(case.q_lens), np.int32)
    cu[: n + 1] = np.concatenate([[0], np.cumsum(case.q_lens)])
    kv = np.zeros(case.max_seqs, np.int32)
    kv[:n] = case.kv_lens
    dtype = jnp.dtype(case.dtype)
    kk, kv_key, kq = jax.random.split(jax.random.key(seed), 3)
    shape = (num_blocks, b, case.num_kv_heads, case.head_dim)
    k_cache = jax.random.normal(kk, shape, dtype)
    v_cache = jax.random.normal(kv_key, shape, dtype)
    q = jax.random.normal(kq, (case.num_tokens, case.num_q_heads, case.head_dim), dtype)
    return (q, k_cache, v_cache, jnp.asarray(kv), jnp.asarray(tables), jnp.asarray(cu),
            jnp.asarray([n], jnp.int32))


def backend_fn(name: str, case: Case, interpret: bool, **kw):
    sm_scale = case.head_dim ** -0.5
    if name == "reference":
        f = lambda *a: ragged_paged_attention_reference(*a, sm_scale=sm_scale, **kw)  # noqa: E731
    elif name == "dense":
        f = lambda *a: ragged_paged_attention_dense(*a, sm_scale=sm_scale)  # noqa: E731
    elif name == "pallas":
        f = lambda *a: ragged_paged_attention_triton(*a, sm_scale=sm_scale, interpret=interpret, **kw)  # noqa: E731
    else:
        raise ValueError(name)
    return jax.jit(f)


def time_fn(fn, args, reps: int, min_reps: int = 3, budget_s: float = 20.0):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    times = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), len(times), compile_s


def copy_bandwidth(mib: int, reps: int = 7) -> dict:
    """Read+write bytes per second of an on-device copy (jit of x + 1), and numpy on CPU."""
    n = mib * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    med, best, _, _ = time_fn(f, (x,), reps, min_reps=reps)
    out = {"device_copy_gb_s": round(2 * n * 4 / med / 1e9, 2), "device_copy_gb_s_best": round(2 * n * 4 / best / 1e9, 2),
           "copy_mib": mib}
    if jax.default_backend() == "cpu":
        src = np.ones(n, np.float32)
        dst = np.empty_like(src)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(dst, src)
            ts.append(time.perf_counter() - t)
        out["numpy_copy_gb_s"] = round(2 * n * 4 / statistics.median(ts) / 1e9, 2)
    del x
    return out


def cpu_cases() -> list[Case]:
    rng = np.random.default_rng(0)
    smol = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float32")
    dec16 = [int(x) for x in rng.integers(256, 1025, 16)]
    dec64 = [int(x) for x in rng.integers(128, 2049, 64)]
    skew = [4096] + [128] * 31
    mixed_kv = [640] + [int(x) for x in rng.integers(256, 1025, 15)]
    return [
        Case("decode_s16_ctx256-1k_smollm2", [1] * 16, dec16, **smol, num_tokens=16, max_seqs=16, max_blocks=128),
        Case("decode_s64_ctx128-2k_smollm2", [1] * 64, dec64, **smol, num_tokens=64, max_seqs=64, max_blocks=128),
        Case("decode_s32_skewed_1x4k_31x128_smollm2", [1] * 32, skew, **smol, num_tokens=32, max_seqs=32,
             max_blocks=256),
        Case("mixed_t256_s16_prefill128_15dec_smollm2", [128] + [1] * 15, mixed_kv, **smol, num_tokens=256,
             max_seqs=16, max_blocks=128),
        Case("prefill_t512_s8_2x256_smollm2", [256, 256], [256, 512], **smol, num_tokens=512, max_seqs=8,
             max_blocks=128),
        Case("decode_s8_ctx2k_llama8b_heads_f32", [1] * 8, [2048] * 8, **llama, num_tokens=8, max_seqs=8,
             max_blocks=128),
    ]


def gpu_cases() -> list[Case]:
    """Llama-3-8B head layout, bfloat16, decode: 64-256 sequences x 1k-8k context."""
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    cases = []
    for s in (64, 128, 256):
        for ctx in (1024, 2048, 4096, 8192):
            cases.append(Case(f"decode_s{s}_ctx{ctx}_llama8b", [1] * s, [ctx] * s, **llama, num_tokens=s,
                              max_seqs=s, max_blocks=8192 // 16))
    rng = np.random.default_rng(1)
    kv = [int(x) for x in rng.integers(512, 8193, 128)]
    cases.append(Case("decode_s128_ctx512-8k_llama8b", [1] * 128, kv, **llama, num_tokens=128, max_seqs=128,
                      max_blocks=512))
    mixed_kv = [2048, 2048] + [int(x) for x in rng.integers(1024, 4097, 62)]
    cases.append(Case("mixed_t1024_s64_2x480prefill_62dec_llama8b", [480, 480] + [1] * 62, mixed_kv, **llama,
                      num_tokens=1024, max_seqs=64, max_blocks=512))
    return cases


def smoke_cases() -> list[Case]:
    small = dict(num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=8, dtype="float32")
    return [
        Case("smoke_decode", [1] * 4, [40, 17, 64, 9], **small, num_tokens=8, max_seqs=8, max_blocks=16),
        Case("smoke_mixed", [12, 1, 1], [30, 50, 3], **small, num_tokens=16, max_seqs=4, max_blocks=16),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("cpu", "gpu", "smoke"), default=None,
                    help="default: gpu on a GPU, else cpu")
    ap.add_argument("--backends", default=None, help="comma list of reference,dense,pallas")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=20.0, help="time budget per case and backend")
    ap.add_argument("--copy-mib", type=int, default=None)
    ap.add_argument("--interpret", action="store_true", help="allow the Pallas kernel in interpret mode")
    ap.add_argument("--dense-max-gib", type=float, default=1.0, help="skip dense where its gather is larger")
    ap.add_argument("--only", default=None, help="substring filter on case names")
    ap.add_argument("--out", default=None, help="write the JSON document here")
    a = ap.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    suite = a.suite or ("gpu" if on_gpu else "cpu")
    cases = {"cpu": cpu_cases, "gpu": gpu_cases, "smoke": smoke_cases}[suite]()
    if a.only:
        cases = [c for c in cases if a.only in c.name]
    if a.backends:
        backends = a.backends.split(",")
    else:
        backends = ["pallas", "reference"] if on_gpu else ["reference", "dense"]
        if suite == "smoke":
            backends = ["reference", "dense", "pallas"]
    interpret = not on_gpu
    if "pallas" in backends and interpret and not (a.interpret or suite == "smoke"):
        backends.remove("pallas")

    ceiling = copy_bandwidth(a.copy_mib or (2048 if on_gpu else 512 if suite != "smoke" else 16))
    ceiling_gb_s = ceiling["device_copy_gb_s"]
    if "numpy_copy_gb_s" in ceiling:
        ceiling_gb_s = max(ceiling_gb_s, ceiling["numpy_copy_gb_s"])
    header = {
        "what": "machine", "jax": jax.__version__, "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        **ceiling, "ceiling_gb_s": ceiling_gb_s,
    }
    print(json.dumps(header), flush=True)
    results = []
    for case in cases:
        args = build(case)
        nbytes = case.needed_bytes()
        for backend in backends:
            row = {"what": "attention", "case": case.name, "kind": case.kind, "backend": backend,
                   "num_seqs": len(case.q_lens), "num_tokens_real": sum(case.q_lens), "T": case.num_tokens,
                   "S": case.max_seqs, "max_blocks": case.max_blocks, "heads": [case.num_q_heads, case.num_kv_heads],
                   "head_dim": case.head_dim, "block_size": case.block_size, "dtype": case.dtype,
                   "sum_kv_len": sum(case.kv_lens), "kv_bytes_needed": nbytes}
            if backend == "dense" and case.dense_gather_bytes() > a.dense_max_gib * 2**30:
                row["skipped"] = f"dense gather {case.dense_gather_bytes() / 2**30:.1f} GiB > --dense-max-gib"
                print(json.dumps(row), flush=True)
                results.append(row)
                continue
            fn = backend_fn(backend, case, interpret)
            med, best, n, compile_s = time_fn(fn, args, a.reps, budget_s=a.budget_s)
            row.update({
                "median_ms": round(med * 1e3, 4), "min_ms": round(best * 1e3, 4), "reps": n,
                "first_call_s": round(compile_s, 2),
                "gb_s": round(nbytes / med / 1e9, 3),
                "fraction_of_ceiling": round(nbytes / med / 1e9 / ceiling_gb_s, 4),
            })
            if backend == "pallas" and interpret:
                row["note"] = "interpret mode: not a speed figure"
            print(json.dumps(row), flush=True)
            results.append(row)
        del args
    doc = {"machine": header, "results": results,
           "command": "python benchmarks/kernel_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Ragged paged attention backends on decode and mixed batches: time and achieved bandwidth.

For every case and backend it prints one JSON line (and writes them all to --out):
median / min wall time over repetitions, the bytes of K and V the batch actually needs
(each real sequence's keys in its attention range, K and V, one layer), the bandwidth that
implies, and its fraction of the machine's memory bandwidth measured in the same run
(the best of: read + write bytes of a large on-device copy and of a numpy copy, and the
read bytes of a numpy sum and of an on-device sum). Backends: "cpu" (the C++ FFI kernel the
CPU model runs), "reference" (the jnp path), "dense" (naive: every row gathers its whole
table and masks) and
"pallas" (the Pallas Triton kernel end to end, tile plan included: compiled on a GPU; on
CPU only with --interpret, which times the interpreter and is meaningless as a speed
figure) and "pallas_kernel" (the pallas_call alone, inputs prepared beforehand).

--check first runs the correctness grid: the Pallas kernel (compiled natively on a GPU,
interpreted on CPU) against the jnp reference and a float64 numpy oracle on hostile
batches (NaN in unused blocks and padding rows, stale tails), and exits 1 on a failure.
--tune times a few kernel configurations on two decode cases and reports the best.

Examples:
  python benchmarks/kernel_bench.py --suite cpu --out benchmarks/results/kernel_bench_cpu.json
  python benchmarks/kernel_bench.py --suite gpu --out "$OUT/kernel_bench_gpu.json"   # on a GPU
  python benchmarks/kernel_bench.py --suite smoke                                   # seconds, any machine
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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

from pallas_kernels.ragged_paged_attention import triton_gpu  # noqa: E402
from pallas_kernels.ragged_paged_attention.cpu import ragged_paged_attention_cpu  # noqa: E402
from pallas_kernels.ragged_paged_attention.reference import (  # noqa: E402
    ragged_paged_attention_dense,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention.testing import make_batch, reference_f64, relative_error  # noqa: E402
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
    dtype: str  # of q and, unless kv_dtype is given, of the cache
    num_tokens: int  # token bucket T
    max_seqs: int  # sequence bucket S
    max_blocks: int  # table width (max_model_len / block_size)

    with_reference: bool = True
    kv_dtype: str | None = None  # e.g. a bfloat16 cache under float32 queries (kv_cache_dtype)

    @property
    def kind(self) -> str:
        return "decode" if max(self.q_lens) == 1 else "mixed"

    def needed_bytes(self) -> int:
        keys = sum(self.kv_lens)
        return 2 * keys * self.num_kv_heads * self.head_dim * jnp.dtype(self.kv_dtype or self.dtype).itemsize

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
        tables[i, :n] = perm[cursor : cursor + n]
        cursor += n
    n = len(case.q_lens)
    cu = np.full(case.max_seqs + 1, sum(case.q_lens), np.int32)
    cu[: n + 1] = np.concatenate([[0], np.cumsum(case.q_lens)])
    kv = np.zeros(case.max_seqs, np.int32)
    kv[:n] = case.kv_lens
    dtype = jnp.dtype(case.dtype)
    kk, kv_key, kq = jax.random.split(jax.random.key(seed), 3)
    shape = (num_blocks, b, case.num_kv_heads, case.head_dim)
    k_cache = jax.random.normal(kk, shape, case.kv_dtype or dtype)
    v_cache = jax.random.normal(kv_key, shape, case.kv_dtype or dtype)
    q = jax.random.normal(kq, (case.num_tokens, case.num_q_heads, case.head_dim), dtype)
    return (q, k_cache, v_cache, jnp.asarray(kv), jnp.asarray(tables), jnp.asarray(cu), jnp.asarray([n], jnp.int32))


def backend_fn(name: str, case: Case, interpret: bool, args=None, **kw):
    """A jitted callable and the arguments to time it on."""
    sm_scale = case.head_dim**-0.5
    if name == "pallas_kernel":  # the pallas_call alone, on inputs prepared outside the timing
        q, k_cache, v_cache, kv_lens, tables, cu, num_seqs = args
        hkv = case.num_kv_heads
        cfg = triton_gpu.resolve_config(q.shape, k_cache.shape, tables.shape, **kw)
        prep = jax.jit(lambda q, kv, t, c, n: triton_gpu.prepare(q, kv, t, c, n, num_kv_heads=hkv, cfg=cfg))(
            q, kv_lens, tables, cu, num_seqs
        )
        prep = jax.block_until_ready(prep)._replace(plan=None)
        group = case.num_q_heads // hkv
        f = jax.jit(
            lambda prep, k, v: triton_gpu.launch(
                prep, k, v, cfg=cfg, group=group, sm_scale=sm_scale, interpret=interpret
            )
        )
        return f, (prep, k_cache, v_cache)
    if name == "reference":
        f = lambda *a: ragged_paged_attention_reference(*a, sm_scale=sm_scale, **kw)  # noqa: E731
    elif name == "cpu":
        f = lambda *a: ragged_paged_attention_cpu(*a, sm_scale=sm_scale, **kw)  # noqa: E731
    elif name == "dense":
        f = lambda *a: ragged_paged_attention_dense(*a, sm_scale=sm_scale)  # noqa: E731
    elif name == "pallas":
        f = lambda *a: ragged_paged_attention_triton(*a, sm_scale=sm_scale, interpret=interpret, **kw)  # noqa: E731
    else:
        raise ValueError(name)
    return jax.jit(f), args


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
    """Read+write bytes per second of an on-device copy (jit of x + 1) and read bytes per second of
    an on-device sum; on CPU also a numpy copy (into a preallocated array) and a numpy sum."""
    n = mib * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    med, best, _, _ = time_fn(f, (x,), reps, min_reps=reps)
    out = {
        "device_copy_gb_s": round(2 * n * 4 / med / 1e9, 2),
        "device_copy_gb_s_best": round(2 * n * 4 / best / 1e9, 2),
        "copy_mib": mib,
    }
    med, _, _, _ = time_fn(jax.jit(jnp.sum), (x,), reps, min_reps=reps)
    out["device_read_gb_s"] = round(n * 4 / med / 1e9, 2)
    if jax.default_backend() == "cpu":
        src = np.ones(n, np.float32)
        dst = np.empty_like(src)
        for name, op, nbytes in (
            ("numpy_copy_gb_s", lambda: np.copyto(dst, src), 2 * n * 4),
            ("numpy_read_gb_s", lambda: src.sum(), n * 4),
        ):
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                op()
                ts.append(time.perf_counter() - t)
            out[name] = round(nbytes / statistics.median(ts) / 1e9, 2)
    del x
    return out


def cpu_cases() -> list[Case]:
    rng = np.random.default_rng(0)
    smol = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float32")
    dec16 = [int(x) for x in rng.integers(256, 1025, 16)]
    dec64 = [int(x) for x in rng.integers(128, 2049, 64)]
    dec64_long = [int(x) for x in np.random.default_rng(2).integers(1024, 2049, 64)]  # issue 9's goal case
    skew = [4096] + [128] * 31
    mixed_kv = [640] + [int(x) for x in rng.integers(256, 1025, 15)]
    return [
        Case("decode_s16_ctx256-1k_smollm2", [1] * 16, dec16, **smol, num_tokens=16, max_seqs=16, max_blocks=128),
        Case("decode_s64_ctx128-2k_smollm2", [1] * 64, dec64, **smol, num_tokens=64, max_seqs=64, max_blocks=128),
        Case("decode_s64_ctx1k-2k_smollm2", [1] * 64, dec64_long, **smol, num_tokens=64, max_seqs=64, max_blocks=128),
        Case(
            "decode_s64_ctx1k-2k_smollm2_bf16kv",
            [1] * 64,
            dec64_long,
            **smol,
            num_tokens=64,
            max_seqs=64,
            max_blocks=128,
            kv_dtype="bfloat16",
        ),
        Case(
            "decode_s32_skewed_1x4k_31x128_smollm2", [1] * 32, skew, **smol, num_tokens=32, max_seqs=32, max_blocks=256
        ),
        Case(
            "mixed_t256_s16_prefill128_15dec_smollm2",
            [128] + [1] * 15,
            mixed_kv,
            **smol,
            num_tokens=256,
            max_seqs=16,
            max_blocks=128,
        ),
        Case(
            "prefill_t512_s8_2x256_smollm2", [256, 256], [256, 512], **smol, num_tokens=512, max_seqs=8, max_blocks=128
        ),
        Case(
            "decode_s8_ctx2k_llama8b_heads_f32", [1] * 8, [2048] * 8, **llama, num_tokens=8, max_seqs=8, max_blocks=128
        ),
    ]


def gpu_cases() -> list[Case]:
    """Llama-3-8B head layout, bfloat16, decode: 64-256 sequences x 1k-8k context."""
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    cases = []
    for s in (64, 128, 256):
        for ctx in (1024, 2048, 4096, 8192):
            cases.append(
                Case(
                    f"decode_s{s}_ctx{ctx}_llama8b",
                    [1] * s,
                    [ctx] * s,
                    **llama,
                    num_tokens=s,
                    max_seqs=s,
                    max_blocks=8192 // 16,
                    with_reference=s * ctx <= 128 * 2048,
                )
            )
    rng = np.random.default_rng(1)
    kv = [int(x) for x in rng.integers(512, 8193, 128)]
    cases.append(
        Case(
            "decode_s128_ctx512-8k_llama8b",
            [1] * 128,
            kv,
            **llama,
            num_tokens=128,
            max_seqs=128,
            max_blocks=512,
            with_reference=False,
        )
    )
    mixed_kv = [2048, 2048] + [int(x) for x in rng.integers(1024, 4097, 62)]
    cases.append(
        Case(
            "mixed_t1024_s64_2x480prefill_62dec_llama8b",
            [480, 480] + [1] * 62,
            mixed_kv,
            **llama,
            num_tokens=1024,
            max_seqs=64,
            max_blocks=512,
        )
    )
    return cases


def smoke_cases() -> list[Case]:
    small = dict(num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=8, dtype="float32")
    return [
        Case("smoke_decode", [1] * 4, [40, 17, 64, 9], **small, num_tokens=8, max_seqs=8, max_blocks=16),
        Case("smoke_mixed", [12, 1, 1], [30, 50, 3], **small, num_tokens=16, max_seqs=4, max_blocks=16),
    ]


CHECKS = [  # (name, layout, batch, kernel overrides); sizes scale down with smoke
    (
        "llama_decode_bf16",
        dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"),
        dict(kind="decode", n=16, ctx=3000),
        {},
    ),
    (
        "llama_mixed_bf16",
        dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"),
        dict(kind="mixed", n=12, ctx=2000),
        {},
    ),
    (
        "llama_decode_bf16_splits4",
        dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"),
        dict(kind="decode", n=8, ctx=3000),
        dict(num_kv_splits=4),
    ),
    (
        "gqa3_d64_b8_f32_prefill",
        dict(num_q_heads=12, num_kv_heads=4, head_dim=64, block_size=8, dtype="float32"),
        dict(kind="prefill", n=4, ctx=600),
        {},
    ),
    (
        "mha_d128_b32_bf16_layer1of3",
        dict(num_q_heads=4, num_kv_heads=4, head_dim=128, block_size=32, dtype="bfloat16"),
        dict(kind="mixed", n=6, ctx=900, layers=3),
        {},
    ),
    (
        "window_softcap_f32",
        dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32"),
        dict(kind="mixed", n=6, ctx=900, window=200, soft_cap=30.0),
        {},
    ),
]


def _check_batch(rng, layout, spec, smoke: bool):
    n, ctx = spec["n"], spec["ctx"]
    if smoke:
        n, ctx = min(n, 4), min(ctx, 80)
    kind = spec["kind"]
    kv_lens = [int(x) for x in rng.integers(max(2, ctx // 4), ctx + 1, n)]
    if kind == "decode":
        q_lens = [1] * n
    elif kind == "prefill":
        q_lens = [min(kv, 3 + i * 7) if i % 2 else kv for i, kv in enumerate(kv_lens)]
        q_lens = [min(q, 48 if smoke else 300) for q in q_lens]
    else:
        q_lens = [1 if i % 2 else min(kv, 5 + 9 * i) for i, kv in enumerate(kv_lens)]
    num_tokens = max(8, 1 << (sum(q_lens) - 1).bit_length())
    return make_batch(
        rng,
        q_lens,
        kv_lens,
        **layout,
        max_seqs=n + 2,
        num_tokens=num_tokens,
        num_layers=spec.get("layers"),
        layer=1 if spec.get("layers") else None,
        sliding_window=spec.get("window"),
    )


def run_checks(smoke: bool, interpret: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for name, layout, spec, overrides in CHECKS:
        t0 = time.perf_counter()
        batch = _check_batch(rng, dict(layout), spec, smoke)
        sm_scale = layout["head_dim"] ** -0.5
        kw = dict(sm_scale=sm_scale, sliding_window=spec.get("window"), soft_cap=spec.get("soft_cap"))
        args = [jnp.asarray(a) for a in batch.args()]
        lay = None if batch.layer is None else jnp.int32(batch.layer)
        pallas = jax.jit(functools.partial(ragged_paged_attention_triton, interpret=interpret, **kw, **overrides))
        ref = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))
        out_p = np.asarray(pallas(*args, layer=lay).astype(jnp.float32))
        out_r = np.asarray(ref(*args, layer=lay).astype(jnp.float32))
        oracle = reference_f64(batch, sm_scale=sm_scale, sliding_window=kw["sliding_window"], soft_cap=kw["soft_cap"])
        n = sum(batch.q_lens)
        tol = 3e-2 if layout["dtype"] == "bfloat16" else 2e-4
        row = {
            "what": "check",
            "name": name,
            "num_seqs": len(batch.q_lens),
            "num_tokens_real": n,
            "max_kv_len": int(max(batch.kv_lens)),
            "dtype": layout["dtype"],
            **overrides,
            "pallas_vs_f64": relative_error(out_p, oracle, batch.q_lens),
            "reference_vs_f64": relative_error(out_r, oracle, batch.q_lens),
            "pallas_vs_reference": relative_error(out_p, out_r.astype(np.float64), batch.q_lens),
            "nan_in_real_rows": bool(np.isnan(out_p[:n]).any() or np.isnan(out_r[:n]).any()),
            "tolerance": tol,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        row["ok"] = not row["nan_in_real_rows"] and row["pallas_vs_f64"] <= tol and row["reference_vs_f64"] <= tol
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


TUNE = [
    dict(chunk_blocks=c, num_warps=w, num_stages=st)
    for c, w, st in [(4, 4, 2), (4, 4, 3), (8, 4, 2), (8, 4, 3), (8, 8, 3), (16, 8, 3)]
] + [dict(block_q=16), dict(num_kv_splits=2)]


def run_tune(cases: list[Case], interpret: bool, reps: int, budget_s: float, ceiling_gb_s: float) -> list[dict]:
    rows = []
    for case in cases:
        args = build(case)
        for overrides in TUNE:
            try:
                fn, targs = backend_fn("pallas_kernel", case, interpret, args=args, **overrides)
                med, best, n, compile_s = time_fn(fn, targs, reps, budget_s=budget_s)
            except Exception as e:  # a config the compiler rejects is a result, not a crash
                row = {"what": "tune", "case": case.name, **overrides, "error": f"{type(e).__name__}: {e}"[:300]}
            else:
                gb_s = case.needed_bytes() / med / 1e9
                row = {
                    "what": "tune",
                    "case": case.name,
                    **overrides,
                    "median_ms": round(med * 1e3, 4),
                    "gb_s": round(gb_s, 2),
                    "fraction_of_ceiling": round(gb_s / ceiling_gb_s, 4),
                }
            print(json.dumps(row), flush=True)
            rows.append(row)
        del args
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("cpu", "gpu", "smoke"), default=None, help="default: gpu on a GPU, else cpu")
    ap.add_argument("--backends", default=None, help="comma list of reference,dense,pallas")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="backends alternate, reps/rounds calls each per round")
    ap.add_argument("--budget-s", type=float, default=20.0, help="time budget per configuration of --tune")
    ap.add_argument("--copy-mib", type=int, default=None)
    ap.add_argument("--interpret", action="store_true", help="allow the Pallas kernel in interpret mode")
    ap.add_argument("--dense-max-gib", type=float, default=1.0, help="skip dense where its gather is larger")
    ap.add_argument("--only", default=None, help="substring filter on case names")
    ap.add_argument("--out", default=None, help="write the JSON document here")
    ap.add_argument("--check", action="store_true", help="run the correctness grid first; exit 1 on failure")
    ap.add_argument("--check-only", action="store_true", help="only the correctness grid")
    ap.add_argument("--tune", action="store_true", help="also time a few kernel configurations")
    ap.add_argument("--tune-only", action="store_true", help="only the kernel configuration sweep")
    a = ap.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    suite = a.suite or ("gpu" if on_gpu else "cpu")
    cases = {"cpu": cpu_cases, "gpu": gpu_cases, "smoke": smoke_cases}[suite]()
    if a.only:
        cases = [c for c in cases if a.only in c.name]
    if a.backends:
        backends = a.backends.split(",")
    else:
        backends = ["pallas", "pallas_kernel", "reference"] if on_gpu else ["cpu", "reference", "dense"]
        if suite == "smoke":
            backends = ["reference", "dense", "pallas", "pallas_kernel"] + ([] if on_gpu else ["cpu"])
    interpret = not on_gpu
    if interpret and not (a.interpret or suite == "smoke"):
        backends = [b for b in backends if not b.startswith("pallas")]

    checks = []
    if a.check or a.check_only:
        checks = run_checks(smoke=suite == "smoke", interpret=interpret)
        if a.check_only or not all(r["ok"] for r in checks):
            _write(a.out, {"checks": checks, "command": _command(argv)})
            if not all(r["ok"] for r in checks):
                print("CHECK FAILED", file=sys.stderr)
                sys.exit(1)
            return {"checks": checks}

    ceiling = copy_bandwidth(a.copy_mib or (2048 if on_gpu else 512 if suite != "smoke" else 16))
    ceiling_gb_s = max(
        v
        for k, v in ceiling.items()
        if k in ("device_copy_gb_s", "device_read_gb_s", "numpy_copy_gb_s", "numpy_read_gb_s")
    )
    header = {
        "what": "machine",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        **ceiling,
        "ceiling_gb_s": ceiling_gb_s,
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),  # this machine may be shared
    }
    print(json.dumps(header), flush=True)
    results = []
    for case in [] if a.tune_only else cases:
        args = build(case)
        nbytes = case.needed_bytes()
        timed = []
        for backend in backends:
            row = {
                "what": "attention",
                "case": case.name,
                "kind": case.kind,
                "backend": backend,
                "num_seqs": len(case.q_lens),
                "num_tokens_real": sum(case.q_lens),
                "T": case.num_tokens,
                "S": case.max_seqs,
                "max_blocks": case.max_blocks,
                "heads": [case.num_q_heads, case.num_kv_heads],
                "head_dim": case.head_dim,
                "block_size": case.block_size,
                "dtype": case.dtype,
                "kv_dtype": case.kv_dtype or case.dtype,
                "sum_kv_len": sum(case.kv_lens),
                "kv_bytes_needed": nbytes,
            }
            if backend == "reference" and not case.with_reference:
                continue
            if backend == "dense" and case.dense_gather_bytes() > a.dense_max_gib * 2**30:
                row["skipped"] = f"dense gather {case.dense_gather_bytes() / 2**30:.1f} GiB > --dense-max-gib"
                print(json.dumps(row), flush=True)
                results.append(row)
                continue
            fn, targs = backend_fn(backend, case, interpret, args=args)
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*targs))
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            timed.append((row, fn, targs, [], []))
        # backends take turns, round by round: on a shared machine load drifts between them
        per_round = max(1, a.reps // a.rounds)
        for _ in range(a.rounds):
            for _row, fn, targs, walls, cpus in timed:
                for _ in range(per_round):
                    c, t = time.process_time(), time.perf_counter()
                    jax.block_until_ready(fn(*targs))
                    walls.append(time.perf_counter() - t)
                    cpus.append(time.process_time() - c)
        for row, _fn, _targs, walls, cpus in timed:
            med = statistics.median(walls)
            row.update(
                {
                    "median_ms": round(med * 1e3, 4),
                    "min_ms": round(min(walls) * 1e3, 4),
                    "reps": len(walls),
                    "rounds": a.rounds,
                    "cpu_ms_median": round(statistics.median(cpus) * 1e3, 4),
                    "gb_s": round(nbytes / med / 1e9, 3),
                    "gb_s_at_min": round(nbytes / min(walls) / 1e9, 3),
                    "fraction_of_ceiling": round(nbytes / med / 1e9 / ceiling_gb_s, 4),
                }
            )
            if row["backend"].startswith("pallas") and interpret:
                row["note"] = "interpret mode: not a speed figure"
            print(json.dumps(row), flush=True)
            results.append(row)
        del args, timed
        _write(a.out, {"machine": header, "checks": checks, "results": results, "command": _command(argv)})
    tune = []
    if a.tune or a.tune_only:
        if suite == "gpu":
            tune_cases = [c for c in cases if c.name in ("decode_s128_ctx4096_llama8b", "decode_s64_ctx8192_llama8b")]
        else:
            tune_cases = [c for c in cases if c.kind == "decode"][:1]
        tune = run_tune(tune_cases, interpret, a.reps, min(a.budget_s, 5.0), ceiling_gb_s)
        best = {}
        for r in tune:
            if "gb_s" in r and r["gb_s"] > best.get(r["case"], {}).get("gb_s", -1):
                best[r["case"]] = r
        for r in best.values():
            print(json.dumps({**r, "what": "tune_best"}), flush=True)
    header["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    header["bandwidth_at_end"] = copy_bandwidth(a.copy_mib or (2048 if on_gpu else 512 if suite != "smoke" else 16))
    doc = {"machine": header, "checks": checks, "results": results, "tune": tune, "command": _command(argv)}
    _write(a.out, doc)
    return doc


def _command(argv) -> str:
    return "python benchmarks/kernel_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)


def _write(path, doc) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()

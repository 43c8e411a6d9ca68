#!/usr/bin/env python
"""The batch-throughput table: jaxllm beside its peers at several batch sizes, with start-up and roofline.

For every round and batch size B, `jaxllm bench throughput`'s run (B prompts of `--input-len`
real tokens, `--output-len` greedy tokens each, EOS ignored) and then each peer on the same
token ids, back to back; one engine serves every B (max_num_seqs = the largest B). Per B the
summary holds the medians, the median of the per-round ratios, and the roofline: the output
tok/s the machine allows at best, from its measured ceilings (matmul FLOP/s, memory reads):
every token costs 2 x the model's matmul parameters in FLOPs, and every decode step reads all
weights once plus each sequence's K/V so far. Start-up is `LLM()` in a fresh process, with an
empty and then a warm compilation cache.

`--kernels auto on off` runs one jaxllm engine per `JAXLLM_CPU_KERNELS` setting in the same rounds
(the first is "jaxllm"; the others are compared with it like peers, as `jaxllm-kernels-MODE`), and
`--quantization native none int8 int4` one per `quantization` ("native": the GGUF's own blocks, the
default; the others as `jaxllm-QUANTIZATION`), each with the roofline of the bytes its weights take, and
`--int8-dot auto off` one per `JAXLLM_CPU_INT8_DOT` setting (`jaxllm-int8-dot-MODE`: the quantized kernel's
integer path, self-checked, or its float-activation path), each with the compute roofline of its path.
`--emulate-isa avx2` reruns the script with the kernels built for x86-64-v3 and XLA, PyTorch and
oneDNN held to AVX2: an AVX2 machine's figures on an AVX-512 one, for jaxllm and the peers alike.

    python benchmarks/throughput.py --batches 1 16 64 256 --rounds 3 --out benchmarks/results/throughput_cpu.json
    python benchmarks/throughput.py --batches 1 16 64 --quantization native none int8 int4 \
        --peers transformers llama.cpp --out benchmarks/results/quantization_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
from machine_ceilings import ceilings

from jaxllm.bench import offline
from jaxllm.bench.throughput import jaxllm_run

# what --emulate-isa sets, before JAX or PyTorch starts (in this process and in the peers' it spawns)
EMULATE = {
    "avx2": {
        "JAXLLM_CPU_MARCH": "x86-64-v3",
        "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }
}


def engine_args(args, quantization: str = "native") -> dict:
    return dict(
        max_num_seqs=max(args.batches),
        max_model_len=args.input_len + args.output_len,
        dtype=args.dtype,
        scan_layers=args.scan_layers,
        quantization=None if quantization == "native" else quantization,
    )


def fitted_engine(args, kernels: str = "auto", quantization: str = "native", int8_dot: str = "auto"):
    """`LLM()` with a KV cache that holds every sequence of the largest batch whole: a peer that allocates
    its own cache per sequence is not preempted either (CPU's default budget, 2 GiB, holds ~45k tokens).
    `kernels`, `int8_dot`: `JAXLLM_CPU_KERNELS` and `JAXLLM_CPU_INT8_DOT` while the engine picks its step."""
    os.environ["JAXLLM_CPU_KERNELS"] = kernels
    os.environ["JAXLLM_CPU_INT8_DOT"] = int8_dot
    from jaxllm import LLM
    from jaxllm.runner.kv_cache import bytes_per_block

    llm = LLM(progress=False, **engine_args(args, quantization))
    runner = llm.engine.runner
    needed = max(args.batches) * -(-(args.input_len + args.output_len) // runner.block_size)
    if runner.num_blocks > needed:
        return llm
    per_block = bytes_per_block(runner.loaded.arch, runner.block_size, runner.cache.k.dtype)
    del llm, runner
    return LLM(progress=False, kv_cache_memory_bytes=(needed + 1) * per_block, **engine_args(args, quantization))


def weight_bytes(llm) -> int:
    """What one pass over the engine's weights reads: every array it holds (quantized ones in their bits)."""
    import jax

    return sum(leaf.nbytes for leaf in jax.tree.leaves(llm.engine.runner.params))


def startup(args, cache_dir: str) -> dict:
    """Seconds from a fresh interpreter to a ready `LLM()`, and its compile share."""
    code = (
        "import json, time; t = time.perf_counter(); from jaxllm import LLM; "
        f"llm = LLM(progress=False, compilation_cache_dir={cache_dir!r}, **{engine_args(args)!r}); "
        "print(json.dumps({'ready_s': round(time.perf_counter() - t, 2), "
        "'compile_s': round(llm.engine.runner.compile_seconds, 2), 'buckets': len(llm.engine.runner.buckets)}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def roofline(
    arch, dtype, weights: int, batch: int, input_len: int, output_len: int, ceiling: dict, compute: str | None = None
) -> dict:
    """Best output tok/s for the workload: compute time and weight/KV read time, whichever is larger.

    FLOPs: every token of the prompt and of the output but the last goes through the layers' matmuls,
    the LM head runs once per output token, and attention costs 4·context·Hq·D per token and layer.
    Reads: one pass over the weights (`weights` bytes) per decode step plus each sequence's K/V so far.
    `dtype`: the cache's and the compute's, which picks the matmul ceiling too, unless `compute` names another
    ("int8": the quantized kernel's integer path, for an engine that takes it)."""
    dtype_bytes = np.dtype(dtype).itemsize
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    layer_params = arch.num_layers * (
        h * (arch.num_heads + 2 * arch.num_kv_heads) * d + arch.num_heads * d * h + 3 * h * i
    )
    head_params = arch.vocab_size * h
    tokens = input_len + output_len - 1
    attention = 4 * arch.num_layers * arch.num_heads * d * tokens * (tokens + 1) // 2
    flops = batch * (2 * tokens * layer_params + 2 * output_len * head_params + attention)
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * d * dtype_bytes
    kv_reads = sum(batch * (input_len + step) * kv_per_token for step in range(output_len))
    read_bytes = output_len * weights + kv_reads
    compute_s = flops / (ceiling[f"matmul_{compute or np.dtype(dtype).name}_gflops"] * 1e9)
    memory_s = read_bytes / (ceiling["mem_read_gb_s"] * 1e9)
    return {
        "compute_s": round(compute_s, 3),
        "memory_s": round(memory_s, 3),
        "output_tok_per_s": round(batch * output_len / max(compute_s, memory_s), 1),
        "bound": "compute" if compute_s > memory_s else "memory",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--peers", nargs="*", default=sorted(offline.PEERS), choices=sorted(offline.PEERS))
    ap.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "on", "off"])
    ap.add_argument("--quantization", nargs="+", default=["native"], choices=["native", "none", "int8", "int4"])
    ap.add_argument("--int8-dot", nargs="+", default=["auto"], choices=["auto", "on", "off"])
    ap.add_argument("--emulate-isa", choices=sorted(EMULATE), default=None)
    ap.add_argument("--out", default=None, help="JSON file for the whole report")
    args = ap.parse_args()
    if args.emulate_isa and any(os.environ.get(k) != v for k, v in EMULATE[args.emulate_isa].items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **EMULATE[args.emulate_isa]})

    report = {
        "workload": {k: getattr(args, k) for k in ("batches", "input_len", "output_len", "rounds")},
        "machine": offline.machine_info(),
        "ceilings": ceilings(),
        "engine_args": engine_args(args),
        "emulate_isa": args.emulate_isa and EMULATE[args.emulate_isa],
    }
    print(json.dumps(report["ceilings"]), file=sys.stderr)
    if not args.skip_startup:
        with tempfile.TemporaryDirectory() as cache:
            report["startup"] = {"cold_cache": startup(args, cache), "warm_cache": startup(args, cache)}
        print(json.dumps(report["startup"]), file=sys.stderr)

    first = (args.kernels[0], args.quantization[0], args.int8_dot[0])
    settings = {"jaxllm": first}
    settings |= {f"jaxllm-kernels-{mode}": (mode, *first[1:]) for mode in args.kernels[1:]}
    settings |= {f"jaxllm-{q}": (first[0], q, first[2]) for q in args.quantization[1:]}
    settings |= {f"jaxllm-int8-dot-{mode}": (*first[:2], mode) for mode in args.int8_dot[1:]}
    engines = {name: fitted_engine(args, *setting) for name, setting in settings.items()}
    report["weight_bytes"] = {name: weight_bytes(llm) for name, llm in engines.items()}
    report["cpu_kernels"] = {name: offline.cpu_kernel_info(llm) for name, llm in engines.items()}
    # the compute ceiling of each engine's path: the integer one's where its quantized matmuls take it
    compute = {
        name: "int8" if (info or {}).get("int8_min_rows") and "matmul_int8_gflops" in report["ceilings"] else None
        for name, info in report["cpu_kernels"].items()
    }
    llm = engines["jaxllm"]
    loaded = llm.engine.runner.loaded
    arch = loaded.arch
    prompts = offline.make_prompts(llm.get_tokenizer(), max(args.batches), args.input_len)
    for engine in engines.values():  # each batch's prefill and decode buckets once: round 0 pays first-run costs
        for batch in args.batches:
            offline.run_batch(engine, prompts[:batch], 2)
    others = [name for name in engines if name != "jaxllm"]
    runs = []
    for index in range(args.rounds):
        for batch in args.batches:
            row = {"round": index, "batch": batch}
            for name, engine in engines.items():
                row[name] = jaxllm_run(engine, prompts[:batch], args.output_len)
            for peer in args.peers:
                row[peer] = offline.run_peer(
                    peer, prompts[:batch], args.output_len, num_iters=1, warmup_iters=1, threads=args.peer_threads
                )
            print(json.dumps(row), file=sys.stderr)
            runs.append(row)
    report["runs"] = runs

    summary = {}
    for batch in args.batches:
        rows = [r for r in runs if r["batch"] == batch]
        ours = [r["jaxllm"]["output_tokens_per_second"] for r in rows]
        entry = {
            "jaxllm_tok_per_s": round(statistics.median(ours), 2),
            "host_ms_per_step": round(statistics.median(r["jaxllm"]["host_ms_per_step"] for r in rows), 2),
        }
        rooflines = {
            name: roofline(
                arch, loaded.dtype, size, batch, args.input_len, args.output_len, report["ceilings"], compute[name]
            )
            for name, size in report["weight_bytes"].items()
        }
        entry["roofline"] = rooflines["jaxllm"]
        for peer in [*others, *args.peers]:
            ok = [
                (r["jaxllm"]["output_tokens_per_second"], r[peer]["output_tokens_per_second"])
                for r in rows
                if "error" not in r[peer]
            ]
            entry[peer] = (
                {
                    "tok_per_s": round(statistics.median(t for _, t in ok), 2),
                    "ratio": offline.median_ratio([a for a, _ in ok], [b for _, b in ok]),
                }
                if ok
                else {"error": rows[0][peer]["error"][-300:]}
            )
            if peer in rooflines:
                entry[peer]["roofline"] = rooflines[peer]
        summary[f"batch_{batch}"] = entry
    report["summary"] = summary
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

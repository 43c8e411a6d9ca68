#!/usr/bin/env python
"""Output tok/s through `jaxllm serve` with --data-parallel-size 1 and 2 (or more), rounds alternated.

Each round starts a fresh server per size and replays the same `jaxllm bench serve` workload
(random prompts, all sent at once, EOS ignored); writes every run and the median per size, and
the median of the per-round ratios against the first size, as JSON.

    python benchmarks/data_parallel.py --sizes 1 2 --rounds 2 --output benchmarks/results/data_parallel_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxllm.bench.server_process import ServerProcess

ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "512", "--dtype", "float32"]


def one_run(size: int, args, workdir: Path, round_: int) -> dict:
    out = workdir / f"dp{size}-{round_}.json"
    with ServerProcess(
        [*ENGINE, "--data-parallel-size", str(size)], log_path=workdir / f"dp{size}-{round_}.log"
    ) as server:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxllm.entrypoints.cli",
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--num-prompts",
                str(args.num_prompts),
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--request-rate",
                "inf",
                "--output",
                str(out),
                "--disable-tqdm",
            ],
            check=True,
            capture_output=True,
        )
    result = json.loads(out.read_text())
    return {
        key: result[key]
        for key in ("duration", "completed", "failed", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="jaxllm-dp-"))
    runs = {size: [] for size in args.sizes}
    load = [os.getloadavg()[0]]
    for round_ in range(args.rounds):
        for size in args.sizes:
            runs[size].append(one_run(size, args, workdir, round_))
            print(f"round {round_} DP={size}: {runs[size][-1]['output_throughput']:.1f} output tok/s", flush=True)
    load.append(os.getloadavg()[0])
    base = args.sizes[0]
    summary = {
        size: {
            "median_output_tok_per_s": statistics.median(r["output_throughput"] for r in rs),
            f"ratio_vs_dp{base}": statistics.median(
                r["output_throughput"] / b["output_throughput"] for r, b in zip(rs, runs[base], strict=True)
            ),
        }
        for size, rs in runs.items()
    }
    result = {
        "workload": vars(args),
        "engine_flags": ENGINE,
        "load_average_start_end": load,
        "runs": runs,
        "summary": summary,
    }
    print(json.dumps(summary, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

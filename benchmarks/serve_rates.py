#!/usr/bin/env python
"""TTFT and TPOT through `jaxllm serve` at several request rates, with `jaxllm bench serve`.

One server (started here on a loopback port, or `--base-url` of a running one) serves every
rate in turn; each rate replays the same random dataset (same seed: same prompts, lengths and
Poisson arrival pattern scaled to the rate). Each rate's full result JSON (vLLM's keys and
per-request arrays) goes next to `--out`, which gets the summary table and the load average.

    python benchmarks/serve_rates.py --rates 1 4 16 --num-prompts 64 --input-len 128 --output-len 64 \\
        --out benchmarks/results/serve_rates_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import time
from pathlib import Path

from jaxllm.bench import datasets, serve
from jaxllm.bench.server_process import ServerProcess
from jaxllm.entrypoints.cli import build_parser

KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
    "max_concurrent_requests",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds per request: above the server's capacity requests queue for long",
    )
    parser.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--server-flags", default="--max-model-len 256", help="flags for the server started here")
    parser.add_argument("--out", default="benchmarks/results/serve_rates_cpu.json")
    args = parser.parse_args()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
        },
        "server_flags": None if args.base_url else args.server_flags,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rates": {},
    }
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            started = time.perf_counter()
            server = stack.enter_context(ServerProcess(shlex.split(args.server_flags)))
            base_url = server.url
            summary["server_start_s"] = round(time.perf_counter() - started, 1)
        warm_up(base_url)
        for rate in args.rates:
            load_before = os.getloadavg()[0]
            result = serve.main(
                build_parser().parse_args(
                    [
                        "bench",
                        "serve",
                        "--base-url",
                        base_url,
                        "--num-prompts",
                        str(args.num_prompts),
                        "--random-input-len",
                        str(args.input_len),
                        "--random-output-len",
                        str(args.output_len),
                        "--request-rate",
                        str(rate),
                        "--seed",
                        str(args.seed),
                        "--timeout",
                        str(args.timeout),
                        "--disable-tqdm",
                        "--output",
                        str(out.with_name(f"{out.stem}_rate{rate:g}.json")),
                    ]
                )
            )
            summary["rates"][f"{rate:g}"] = {
                **{k: result[k] for k in KEYS},
                "load_average_1m": [load_before, os.getloadavg()[0]],
            }
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{'rate':>6} {'TTFT mean':>10} {'TTFT p99':>9} {'TPOT mean':>10} {'TPOT p99':>9} {'tok/s':>7}  (ms)")
    for rate, r in summary["rates"].items():
        print(
            f"{rate:>6} {r['mean_ttft_ms']:>10.1f} {r['p99_ttft_ms']:>9.1f} {r['mean_tpot_ms']:>10.1f} "
            f"{r['p99_tpot_ms']:>9.1f} {r['output_throughput']:>7.1f}"
        )
    print(f"summary: {out}")


def warm_up(base_url: str) -> None:
    """Two short requests first, so the first measured request meets a warm server."""
    requests = datasets.random_requests(2, input_len=16, output_len=4, seed=99)
    headers = serve.auth_headers(os.environ.get("JAXLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    records, _ = asyncio.run(
        serve.run(requests, url=base_url + serve.ENDPOINT, model=serve.first_model(base_url, headers), headers=headers)
    )
    if not all(r.success for r in records):
        raise RuntimeError(f"warm-up failed: {[r.error for r in records]}")


if __name__ == "__main__":
    main()

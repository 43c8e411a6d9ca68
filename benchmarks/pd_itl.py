#!/usr/bin/env python
"""Inter-token latency of short streams while long prompts arrive: one engine vs prefill/decode disaggregation.

The same mixed trace, in interleaved rounds, against (a) one `jaxllm serve` and (b) `jaxllm router` in front of a
producer and a consumer `jaxllm serve` (TransferConnector): short streams (`--short-prompt` tokens in,
`--short-output` out) arrive at `--rate` per second, and `--long` long prompts (`--long-prompt` tokens, a few
tokens out) arrive among them. Reported per setup: the short streams' ITL p50/p99 and TTFT, the long prompts'
TTFT, with medians over rounds and the per-round P/D / single ratios. Every server runs on this machine, so on a
small one the producer's prefill competes with the consumer's decode for the same cores (docs/disaggregated.md
says what that can and cannot show).

    python benchmarks/pd_itl.py --rounds 3 --out benchmarks/results/pd_itl_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np

from jaxllm.bench.offline import machine_info
from jaxllm.bench.serve import first_model, run
from jaxllm.bench.server_process import ServerProcess, free_port
from jaxllm.sim.trace import TraceRequest

ENGINE = ["--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--max-model-len", "1024", "--dtype", "float32"]


def trace(args) -> list[TraceRequest]:
    requests = [
        TraceRequest(arrival_time=i / args.rate, output_len=args.short_output, prompt_len=args.short_prompt)
        for i in range(args.short)
    ]
    span = args.short / args.rate
    requests += [
        TraceRequest(arrival_time=span * (j + 0.5) / args.long, output_len=4, prompt_len=args.long_prompt)
        for j in range(args.long)
    ]
    return sorted(requests, key=lambda r: r.arrival_time)


class Router:
    """`jaxllm router` as a subprocess, ready once /health answers."""

    def __init__(self, prefill: str, decode: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "jaxllm.entrypoints.cli", "router", "--prefill", prefill, "--decode", decode]
        self.process = subprocess.Popen(
            command + ["--port", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("the router did not become healthy")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def measure(url: str, requests: list[TraceRequest], args, seed: int) -> dict:
    """One run of the trace; `seed` picks its prompts' tokens (a new seed: nothing in any prefix cache)."""
    model = first_model(url, {})
    records, duration = asyncio.run(run(requests, url=url + "/v1/completions", model=model, headers={}, seed=seed))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    short = [r for r, q in zip(records, requests, strict=True) if q.prompt_len == args.short_prompt]
    long = [r for r, q in zip(records, requests, strict=True) if q.prompt_len == args.long_prompt]
    itl = np.array([t for r in short for t in r.itl]) * 1000
    return {
        "short_itl_ms_p50": round(float(np.percentile(itl, 50)), 1),
        "short_itl_ms_p99": round(float(np.percentile(itl, 99)), 1),
        "short_ttft_ms_median": round(1000 * statistics.median(r.ttft for r in short), 1),
        "long_ttft_ms_median": round(1000 * statistics.median(r.ttft for r in long), 1),
        "duration_s": round(duration, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--short-prompt", type=int, default=32)
    parser.add_argument("--short-output", type=int, default=48)
    parser.add_argument("--long", type=int, default=3)
    parser.add_argument("--long-prompt", type=int, default=900)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    requests = trace(args)
    transfer = '{"kv_connector": "TransferConnector", "kv_role": "%s"}'
    load_before = os.getloadavg()
    with (
        ServerProcess(ENGINE) as single,
        ServerProcess(ENGINE + ["--kv-transfer-config", transfer % "kv_producer"]) as producer,
        ServerProcess(ENGINE + ["--kv-transfer-config", transfer % "kv_consumer"]) as consumer,
    ):
        router = Router(producer.url, consumer.url)
        try:
            setups = {"single": single.url, "pd": router.url}
            for url in setups.values():  # warm-up
                measure(url, requests, args, seed=10_000)
            rounds: dict[str, list[dict]] = {name: [] for name in setups}
            for i in range(args.rounds):
                for name, url in setups.items():
                    rounds[name].append(measure(url, requests, args, seed=i))
        finally:
            router.stop()
    summary = {}
    for name, results in rounds.items():
        summary[name] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    summary["pd_over_single_per_round"] = {
        key: [round(p[key] / s[key], 2) for p, s in zip(rounds["pd"], rounds["single"], strict=True)]
        for key in rounds["pd"][0]
    }
    result = {
        "machine": {**machine_info(), "load_average_before": [round(x, 2) for x in load_before]},
        "trace": {
            k: getattr(args, k) for k in ("short", "short_prompt", "short_output", "long", "long_prompt", "rate")
        },
        "engine_flags": ENGINE,
        "rounds": rounds,
        "summary": summary,
    }
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

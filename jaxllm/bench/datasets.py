"""Benchmark datasets as request traces (`jaxllm.sim.trace`), so a real server and the simulator replay
the same requests.

- `random`: made-up prompts of exact token lengths, lengths uniform in L·[1 − r, 1 + r] (vLLM's
  random dataset; r = `--random-range-ratio`). Arrival times are left at 0: the caller spreads them.
- `jsonl`: a trace file (`--dataset-path`), with its own arrival times, prompts or prompt lengths.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import numpy as np

from jaxllm.sim.synth import LengthDist, arrival_times, synthesize
from jaxllm.sim.trace import TraceRequest, load_trace

DATASETS = ("random", "jsonl")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", choices=DATASETS, default="random")
    group.add_argument("--dataset-path", default=None, help="the JSONL trace (--dataset-name jsonl)")
    group.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests to send (default: 1000 for random, the whole trace for jsonl)",
    )
    group.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (random dataset)")
    group.add_argument("--random-output-len", type=int, default=128, help="tokens to generate (random dataset)")
    group.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths uniform in len·[1 − r, 1 + r], r in [0, 1)"
    )
    group.add_argument("--seed", type=int, default=0, help="seeds made-up prompts and arrival times")


def get_requests(args: argparse.Namespace) -> list[TraceRequest]:
    """The dataset the flags name, as trace requests in arrival order."""
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE")
        return jsonl_requests(args.dataset_path, args.num_prompts)
    return random_requests(
        args.num_prompts or 1000,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
    )


def random_requests(
    num_prompts: int, *, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[TraceRequest]:
    for flag, value in (("--random-input-len", input_len), ("--random-output-len", output_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    return synthesize(
        num_prompts,
        request_rate=math.inf,
        seed=seed,
        input_len=LengthDist(input_len, "uniform", range_ratio),
        output_len=LengthDist(output_len, "uniform", range_ratio),
    )


def jsonl_requests(path: str, num_prompts: int | None = None) -> list[TraceRequest]:
    """The trace's first `num_prompts` requests (all by default); a bad line is a ValueError naming it."""
    trace = load_trace(path)
    if not trace:
        raise ValueError(f"{path}: the trace has no requests")
    if num_prompts is not None and num_prompts > len(trace):
        raise ValueError(f"--num-prompts {num_prompts} is more than the {len(trace)} requests in {path}")
    return trace[:num_prompts]


def retime(
    requests: list[TraceRequest], request_rate: float, *, burstiness: float = 1.0, seed: int = 0
) -> list[TraceRequest]:
    """The same requests arriving at `request_rate` per second (Poisson for burstiness 1, gamma gaps
    otherwise; inf: all at once), from a generator of their own so lengths never depend on the rate."""
    times = arrival_times(np.random.default_rng([seed, 1]), len(requests), request_rate, burstiness)
    return [replace(r, arrival_time=float(t)) for r, t in zip(requests, times, strict=True)]

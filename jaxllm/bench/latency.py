"""Batch latency (vLLM's `bench latency`): seconds for one batch of `--batch-size` requests, `--num-iters` times.

Each iteration is one `LLM.generate` call on `--batch-size` prompts of `--input-len` tokens,
each asking for exactly `--output-len` greedy tokens (EOS ignored), after
`--num-iters-warmup` untimed ones. Reported as vLLM does: the average latency, every
latency, and the 10/25/50/75/90/99th percentiles. `--compare` times the peers on the same
batch the same way (each in its own process, after the same warm-up). With `--speculative-config
JSON` the engine speculates, and the report adds the acceptance rate and mean acceptance length
over the timed iterations (`spec_decode`).

    jaxllm bench latency --batch-size 8 --input-len 32 --output-len 128 --num-iters 10 --compare
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxllm.bench import offline
from jaxllm.engine.args import EngineArgs
from jaxllm.metrics.loggers import format_spec_decode

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("workload")
    shape.add_argument("--batch-size", type=int, default=8, help="requests per iteration")
    shape.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    shape.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS ignored)")
    shape.add_argument("--num-iters-warmup", type=int, default=3, help="untimed iterations first")
    shape.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    offline.add_workload_args(parser)
    EngineArgs.add_cli_args(parser)


def validate(args: argparse.Namespace) -> None:
    offline.check_positive(args, "batch_size", "input_len", "output_len", "num_iters")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0 (got {args.num_iters_warmup})")
    offline.check_peer_model(args)
    offline.speculative_config(args)  # a bad --speculative-config fails before anything loads


def latency_stats(latencies: list[float]) -> dict:
    values = np.asarray(latencies, np.float64)
    return {
        "avg_latency": float(values.mean()),
        "latencies": [float(v) for v in values],
        "percentiles": {str(p): float(np.percentile(values, p)) for p in PERCENTILES},
    }


def main(args: argparse.Namespace) -> dict:
    validate(args)
    llm = offline.make_engine(args, max_num_seqs=args.batch_size, max_model_len=args.input_len + args.output_len)
    prompts = offline.make_prompts(llm.get_tokenizer(), args.batch_size, args.input_len)
    for _ in range(args.num_iters_warmup):
        offline.run_batch(llm, prompts, args.output_len)
    spec_before = offline.spec_decode_totals(llm)
    result = latency_stats([offline.run_batch(llm, prompts, args.output_len) for _ in range(args.num_iters)])
    result["workload"] = {
        k: getattr(args, k) for k in ("batch_size", "input_len", "output_len", "num_iters_warmup", "num_iters")
    }
    if (spec := offline.spec_decode_result(offline.spec_decode_totals(llm), spec_before)) is not None:
        result["speculative_config"] = offline.speculative_config(args)
        result["spec_decode"] = spec  # over the timed iterations
    result["machine"] = offline.machine_info()
    print(format_result("jaxllm", result))
    if spec is not None:
        print(format_spec_decode(spec))
    comparison = {}
    for peer in offline.peer_names(args):
        entry = offline.run_peer(
            peer,
            prompts,
            args.output_len,
            num_iters=args.num_iters,
            warmup_iters=args.num_iters_warmup,
            threads=args.peer_threads,
        )
        comparison[peer] = {**entry, **latency_stats(entry["latencies_s"])} if "error" not in entry else entry
        print(format_result(peer, comparison[peer]))
    if comparison:
        result["comparison"] = comparison
    offline.write_json(result, args.output_json)
    if args.plot:
        from jaxllm.bench.offline_plots import plot_latencies

        print(f"plot written to {plot_latencies(result, args.plot)}")
    return result


def format_result(engine: str, result: dict) -> str:
    if "error" in result:
        return f"{engine}: failed ({result['error'].splitlines()[-1] if result['error'] else '?'})"
    pcts = ", ".join(f"p{p} {result['percentiles'][str(p)]:.3f}" for p in PERCENTILES)
    return f"{engine}: avg latency {result['avg_latency']:.3f} s ({pcts})"

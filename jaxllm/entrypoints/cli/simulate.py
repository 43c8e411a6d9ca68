"""`jaxllm simulate TRACE --cost cost.json`: replay a trace through the engine's scheduler on a virtual clock."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# engine settings the simulator uses (vLLM's flag names); unset ones come from the cost model's engine
ENGINE_FLAGS = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "block_size": int,
    "num_gpu_blocks_override": int,
}


def register(sub) -> None:
    parser = sub.add_parser("simulate", help="simulate serving a trace with the engine's own scheduler")
    parser.add_argument("trace", help="JSONL trace (see `jaxllm trace synth`)")
    parser.add_argument("--cost", required=True, metavar="FILE", help="cost model from `jaxllm calibrate`")
    parser.add_argument(
        "--scheduling-policy", default="fcfs", help="fcfs, priority, sjf, lpm, fair, or pkg.module:Class"
    )
    engine = parser.add_argument_group("engine (default: the calibrated engine's)")
    for name, kind in ENGINE_FLAGS.items():
        engine.add_argument("--" + name.replace("_", "-"), type=kind, default=None, metavar=name.upper())
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of made-up prompt tokens (as bench serve's)")
    parser.add_argument(
        "--oracle-output-len",
        action="store_true",
        help="tell policies each request's true output length (sjf's expected_output_len)",
    )
    report = parser.add_argument_group("report")
    report.add_argument("--output", default=None, metavar="FILE", help="write the result JSON here")
    report.add_argument("--plot", default=None, metavar="DIR", help="write latency, throughput and KV-usage PNGs here")
    report.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    report.add_argument("--metric-percentiles", default="99", help="percentiles to report, comma-separated")
    parser.set_defaults(func=run)


def sim_config(args, cost):
    from jaxllm.config import SchedulerConfig
    from jaxllm.sim.simulator import SimConfig

    def setting(name):
        value = getattr(args, name)
        if value is not None:
            return value
        if name == "num_gpu_blocks_override":
            name = "num_blocks"
        if name not in cost.engine:
            raise ValueError(f"--{name.replace('_', '-')} is needed: the cost model does not record it")
        return cost.engine[name]

    scheduler = SchedulerConfig(
        setting("max_num_seqs"), setting("max_num_batched_tokens"), setting("max_model_len"), args.scheduling_policy
    )
    return SimConfig(
        scheduler,
        num_blocks=setting("num_gpu_blocks_override"),
        block_size=setting("block_size"),
        enable_prefix_caching=setting("enable_prefix_caching"),
    )


def run(args) -> dict:
    from jaxllm.bench.results import format_result, per_request
    from jaxllm.bench.serve import parse_goodput, parse_percentiles
    from jaxllm.sim.costmodel import CostModel
    from jaxllm.sim.simulator import cost_model_step_time, simulate
    from jaxllm.sim.trace import load_trace

    cost = CostModel.load(args.cost)
    config = sim_config(args, cost)
    trace = load_trace(args.trace)
    if not trace:
        raise ValueError(f"{args.trace}: the trace is empty")
    started = time.perf_counter()
    sim = simulate(
        trace,
        config,
        cost_model_step_time(cost, config),
        seed=args.seed,
        **cost.event_costs(),
        oracle_output_len=args.oracle_output_len,
    )
    wall = time.perf_counter() - started
    sched = config.scheduler
    result = {
        "backend": "jaxllm-simulator",
        "dataset_path": args.trace,
        "num_prompts": len(trace),
        "request_rate": "trace",
        "scheduling_policy": sched.policy,
        "cost_model": args.cost,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": sched.max_model_len,
        "num_blocks": config.num_blocks,
        "block_size": config.block_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "seed": args.seed,
        "simulation_seconds": wall,
        **sim.to_json(
            goodput=parse_goodput(args.goodput) or None, percentiles=parse_percentiles(args.metric_percentiles)
        ),
    }
    print(format_result(result, title="Simulated Serving Result"))
    print(
        f"{sim.num_steps} steps, {sim.num_preemptions} preemptions, prefix-cache hit rate "
        f"{sim.prefix_cache_hit_rate:.1%}, mean KV usage {result['mean_kv_cache_usage']:.1%}; simulated in {wall:.2f} s"
    )
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({**result, **per_request(sim.records)}) + "\n")
        print(f"result JSON: {args.output}")
    if args.plot:
        from jaxllm.bench.plots import save_plots
        from jaxllm.sim.plots import plot_kv_usage

        paths = save_plots(result, sim.records, args.plot)
        paths.append(plot_kv_usage(sim, Path(args.plot) / "kv_cache_usage.png", title=f"{sched.policy} (simulated)"))
        print("plots:", ", ".join(str(p) for p in paths))
    return result

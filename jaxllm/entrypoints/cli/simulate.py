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
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (n-gram only: its drafts '
        "cost no device time)",
    )
    spec.add_argument(
        "--acceptance-rate",
        type=float,
        default=None,
        metavar="RATE",
        help="chance a draft is accepted given the one before it was, for requests whose trace record carries "
        "no acceptance_rate (draws seeded by --seed)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of made-up prompt tokens (as bench serve's) and of draft acceptance"
    )
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
    from jaxllm.spec_decode.config import SpeculativeConfig

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
        speculative=SpeculativeConfig.parse(args.speculative_config),
    )


def run(args) -> dict:
    from jaxllm.bench.results import format_result, per_request
    from jaxllm.bench.serve import parse_goodput, parse_percentiles
    from jaxllm.sim.costmodel import CostModel
    from jaxllm.sim.simulator import cost_model_step_time, simulate
    from jaxllm.sim.trace import load_trace

    cost = CostModel.load(args.cost)
    config = sim_config(args, cost)
    if args.acceptance_rate is not None and config.speculative is None:
        raise ValueError("--acceptance-rate needs --speculative-config")
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
        acceptance_rate=args.acceptance_rate,
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
        "speculative_config": json.loads(config.speculative.to_json()) if config.speculative else None,
        "acceptance_rate": args.acceptance_rate,
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
    if config.speculative is not None:
        print(speculation_line(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        arrays = per_request(sim.records)
        if sim.draft_tokens is not None:  # speculation, per request (vLLM's per-request arrays' style)
            arrays.update({"draft_tokens": sim.draft_tokens, "accepted_tokens": sim.accepted_tokens})
        Path(args.output).write_text(json.dumps({**result, **arrays}) + "\n")
        print(f"result JSON: {args.output}")
    if args.plot:
        from jaxllm.bench.plots import save_plots
        from jaxllm.sim.plots import plot_kv_usage

        paths = save_plots(result, sim.records, args.plot)
        paths.append(plot_kv_usage(sim, Path(args.plot) / "kv_cache_usage.png", title=f"{sched.policy} (simulated)"))
        print("plots:", ", ".join(str(p) for p in paths))
    return result


def speculation_line(result: dict) -> str:
    """The summary's speculation figures (vLLM's stats-line terms)."""
    rate, length = result["spec_decode_acceptance_rate"], result["spec_decode_mean_acceptance_length"]
    if rate is None:
        return "speculation: no drafts were verified"
    return (
        f"speculation: acceptance rate {rate:.1%}, mean acceptance length {length:.2f}, "
        f"{result['spec_decode_num_drafts']} verifications of {result['spec_decode_num_draft_tokens']} draft tokens "
        f"({result['spec_decode_mean_draft_tokens']:.2f} each), drafts in "
        f"{result['spec_decode_speculated_fraction']:.1%} of {result['spec_decode_num_decodes']} decodes; "
        f"accepted per position {result['spec_decode_num_accepted_tokens_per_pos']}"
    )

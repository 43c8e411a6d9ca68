"""`jaxllm simulate TRACE --cost cost.json`: replay a trace through the engine's scheduler on a virtual clock.

`--pipeline-parallel-size P` simulates the pipeline-parallel engine from a one-stage cost model: the step time
split over the stages by their layers, plus the hidden states' copy between stages (jaxllm/sim/simulator.py).
Tensor parallelism is in the cost model itself: calibrate one with `jaxllm calibrate --tensor-parallel-size N`.
`--instances N --router POLICY` simulates N such engines behind one of `jaxllm router`'s policies (sim/cluster.py);
`--router a,b,c` runs each policy on the same trace and prints them side by side; `--pd P:D` simulates P prefill
and D decode instances behind the router's P/D mode (sim/pd.py).
"""

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
    pipeline = parser.add_argument_group("pipeline parallelism (a one-stage cost model split over the stages)")
    pipeline.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        metavar="P",
        help="stages, a batch in flight per stage; without --num-gpu-blocks-override the KV pool is what the "
        "calibrated engine's KV bytes per device hold when each stage keeps only its layers' K/V",
    )
    pipeline.add_argument(
        "--num-layers",
        type=int,
        default=None,
        metavar="N",
        help="the model's layers, split as the engine splits them (JAXLLM_PP_LAYER_PARTITION honoured) "
        "(default: the cost model's record; without one, an even split)",
    )
    pipeline.add_argument(
        "--pp-layer-partition",
        default=None,
        metavar="COUNTS",
        help='layers per stage, e.g. "15,15" (as JAXLLM_PP_LAYER_PARTITION)',
    )
    pipeline.add_argument(
        "--pp-transfer-latency-s",
        type=float,
        default=None,
        metavar="S",
        help="each stage boundary's copy of a batch's hidden states, per batch (default 1e-4, measured between "
        "two host-platform CPU devices)",
    )
    pipeline.add_argument(
        "--pp-transfer-s-per-token",
        type=float,
        default=None,
        metavar="S",
        help="... and per token of the batch's bucket (default 2e-7: hidden size 576 in float32, the same measurement)",
    )
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
    cluster = parser.add_argument_group("a cluster (N equal engines behind `jaxllm router`'s policies)")
    cluster.add_argument("--instances", type=int, default=None, metavar="N", help="simulated engines (default 1)")
    cluster.add_argument(
        "--router",
        default=None,
        metavar="POLICY[,POLICY...]",
        help="the router's policy: round_robin, least_loaded, session, prefix_aware, or pkg.module:Class; several, "
        "comma-separated: each on the same trace, side by side (default with --instances: round_robin)",
    )
    cluster.add_argument(
        "--router-poll-interval",
        type=float,
        default=None,
        metavar="S",
        help="how often the router reads each instance's load (`jaxllm router --health-check-interval`; default 2, "
        "as there; 0: after every step)",
    )
    cluster.add_argument(
        "--pd",
        default=None,
        metavar="P:D",
        help="disaggregated prefill and decode: P prefill and D decode instances behind `jaxllm router --prefill "
        "--decode` (the least loaded of each kind; a prompt's K/V crosses between them), instead of --instances",
    )
    cluster.add_argument(
        "--kv-transfer-gb-s",
        type=float,
        default=None,
        metavar="GB_S",
        help="--pd: the K/V transfer's bandwidth (default 0.71, the TransferConnector measured on a 2-core CPU)",
    )
    cluster.add_argument(
        "--kv-transfer-latency",
        type=float,
        default=None,
        metavar="S",
        help="--pd: seconds each transfer takes besides its bytes (default 0.005)",
    )
    report = parser.add_argument_group("report")
    report.add_argument("--output", default=None, metavar="FILE", help="write the result JSON here")
    report.add_argument("--plot", default=None, metavar="DIR", help="write latency, throughput and KV-usage PNGs here")
    report.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    report.add_argument("--metric-percentiles", default="99", help="percentiles to report, comma-separated")
    parser.set_defaults(func=run)


def settings_of(args):
    """The engine the flags describe, for `jaxllm.sim.settings.sim_config`."""
    from jaxllm.sim.settings import SimSettings

    return SimSettings.of(
        args,
        num_blocks=args.num_gpu_blocks_override,
        num_layers=args.num_layers,
        pp_layer_partition=args.pp_layer_partition,
    )


def run(args) -> dict:
    from jaxllm.sim.costmodel import CostModel
    from jaxllm.sim.coverage import FROM_COST_MODEL, check_trace_fits
    from jaxllm.sim.settings import sim_config, simulate_priced
    from jaxllm.sim.trace import load_trace

    cluster = cluster_policies(args)  # bad flags fail here, before anything runs
    cost = CostModel.load(args.cost)
    config = sim_config(settings_of(args), cost)
    transfer = {
        name: value
        for name, value in (
            ("pp_transfer_latency_s", args.pp_transfer_latency_s),
            ("pp_transfer_s_per_token", args.pp_transfer_s_per_token),
        )
        if value is not None
    }
    if transfer and config.pipeline_parallel_size == 1:
        raise ValueError("--pp-transfer-* need --pipeline-parallel-size > 1")
    if args.acceptance_rate is not None and config.speculative is None:
        raise ValueError("--acceptance-rate needs --speculative-config")
    trace = load_trace(args.trace)
    if not trace:
        raise ValueError(f"{args.trace}: the trace is empty")
    source = "--max-model-len" if args.max_model_len is not None else FROM_COST_MODEL
    check_trace_fits(trace, config.scheduler.max_model_len, cost.engine, source=source, cost_path=args.cost)
    if cluster is not None:
        return run_cluster(args, trace, config, cost, cluster, transfer)
    started = time.perf_counter()
    sim = simulate_priced(
        trace,
        config,
        cost,
        seed=args.seed,
        oracle_output_len=args.oracle_output_len,
        acceptance_rate=args.acceptance_rate,
        **transfer,
    )
    result = result_json(args, trace, config, cost, sim, time.perf_counter() - started)
    print_summary(args, result, config, cost, sim)
    save(args, result, sim)
    return result


def cluster_policies(args) -> list | None:
    """The router's policy objects for --router (one per name; None: no cluster asked for), checked with the
    other flags before anything runs."""
    if args.pd is not None:
        from jaxllm.sim.pd import parse_pd

        if args.instances is not None or args.router is not None:
            raise ValueError("--pd P:D is its own cluster (least loaded of each kind): leave out --instances/--router")
        parse_pd(args.pd)
    elif args.kv_transfer_gb_s is not None or args.kv_transfer_latency is not None:
        raise ValueError("--kv-transfer-* go with --pd")
    if args.router_poll_interval is not None and (args.pd is not None or args.instances is None):
        raise ValueError("--router-poll-interval goes with --instances N")
    if args.instances is None and args.router is None and args.pd is None:
        return None
    from jaxllm.routing.registry import load_policy

    if args.instances is not None and args.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    names = [name.strip() for name in (args.router or "round_robin").split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise ValueError(f"--router {args.router!r}: policies, comma-separated, each once")
    if args.speculative_config is not None:
        raise ValueError("--instances/--router do not simulate speculative decoding yet")
    if args.plot is not None:
        raise ValueError("--plot is for one engine; a cluster's figures are in --output's JSON")
    if args.pd is not None:
        return [args.pd]
    try:
        return [load_policy(name) for name in names]
    except ValueError as e:  # the registry speaks of the router's flag
        raise ValueError(str(e).replace("--policy", "--router", 1)) from None


def run_cluster(args, trace, config, cost, policies: list, transfer: dict) -> dict:
    """Each policy on the same trace and seed (a paired comparison); one policy: its result JSON, several:
    `{"runs": [...]}` and a table side by side."""
    from jaxllm.bench.serve import parse_goodput, parse_percentiles
    from jaxllm.sim.cluster import simulate_cluster
    from jaxllm.sim.simulator import cost_model_step_time

    instances = args.instances or 1
    goodput, percentiles = parse_goodput(args.goodput) or None, parse_percentiles(args.metric_percentiles)
    summary = {"goodput": goodput, "percentiles": percentiles}
    runs, results = [], []
    for policy in policies:
        started = time.perf_counter()
        if args.pd is not None:
            sim = run_pd(args, trace, config, cost)
        else:
            sim = simulate_cluster(
                trace,
                config,
                cost_model_step_time(cost, config),
                instances,
                policy,
                seed=args.seed,
                oracle_output_len=args.oracle_output_len,
                **cost.event_costs(),
                **transfer,
                **({} if args.router_poll_interval is None else {"poll_interval_s": args.router_poll_interval}),
            )
        wall = time.perf_counter() - started
        result = {**engine_json(args, trace, config, cost), "simulation_seconds": wall, **sim.to_json(**summary)}
        runs.append(sim)
        results.append(result)
    for result, sim in zip(results, runs, strict=True):
        print(cluster_summary(result, sim))
    if len(results) > 1:
        print(compare_table(results))
    out = results[0] if len(results) == 1 else {"routers": [r["router"] for r in results], "runs": results}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out) + "\n")
        print(f"result JSON: {args.output}")
    return out


def run_pd(args, trace, config, cost):
    """`--pd P:D` on the trace: the cluster's result (sim/pd.py)."""
    from jaxllm.sim.pd import parse_pd, simulate_pd
    from jaxllm.sim.simulator import cost_model_step_time
    from jaxllm.tune.space import kv_bytes_per_block

    if args.oracle_output_len or config.pipeline_parallel_size > 1:
        raise ValueError("--pd simulates one-stage instances without --oracle-output-len")
    num_prefill, num_decode = parse_pd(args.pd)
    options = {
        name: value
        for name, value in (
            ("kv_transfer_gb_s", args.kv_transfer_gb_s),
            ("kv_transfer_latency_s", args.kv_transfer_latency),
        )
        if value is not None
    }
    return simulate_pd(
        trace,
        config,
        cost_model_step_time(cost, config),
        num_prefill,
        num_decode,
        kv_bytes_per_token=kv_bytes_per_block(cost, config.block_size) // config.block_size,
        seed=args.seed,
        **cost.event_costs(),
        **options,
    )


def cluster_summary(result: dict, sim) -> str:
    from jaxllm.sim.coverage import failure_line

    lines = [
        f"router {result['router']} over {result['instances']} simulated instances: {result['completed']} requests "
        f"in {result['duration']:.2f} s, prefix-cache hit rate {result['prefix_cache_hit_rate']:.1%}, TTFT mean "
        f"{result['mean_ttft_ms']:.1f} ms p99 {result.get('p99_ttft_ms', float('nan')):.1f} ms"
        + (f", goodput {result['request_goodput']:.2f} req/s" if "request_goodput" in result else "")
        + f"; {result['num_steps']} steps, {result['num_preemptions']} preemptions; simulated in "
        f"{result['simulation_seconds']:.2f} s"
    ]
    served = [p["completed"] + p["failed"] for p in result["per_instance"]]
    lines.append(f"  requests per instance: min {min(served)}, max {max(served)}")
    failed = failure_line([r.error for r in sim.records])
    if failed:
        lines.append("  " + failed)
    return "\n".join(lines)


def compare_table(results: list[dict]) -> str:
    """The policies side by side (one trace, one seed)."""
    rows = [
        ("prefix-cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
        ("mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"),
        ("p99 TTFT (ms)", "p99_ttft_ms", "{:.1f}"),
        ("mean TPOT (ms)", "mean_tpot_ms", "{:.1f}"),
        ("goodput (req/s)", "request_goodput", "{:.2f}"),
        ("throughput (req/s)", "request_throughput", "{:.2f}"),
        ("duration (s)", "duration", "{:.2f}"),
        ("preemptions", "num_preemptions", "{}"),
    ]
    width = max(12, *(len(r["router"]) for r in results))
    lines = [f"{'':<24}" + "".join(f"{r['router']:>{width + 2}}" for r in results)]
    for label, key, fmt in rows:
        if all(key in r and r[key] is not None for r in results):
            lines.append(f"{label:<24}" + "".join(f"{fmt.format(r[key]):>{width + 2}}" for r in results))
    return "\n".join(lines)


def engine_json(args, trace, config, cost) -> dict:
    """The run's trace, engine and seed (the keys before a result's figures)."""
    sched = config.scheduler
    return {
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
        "tensor_parallel_size": cost.engine.get("tensor_parallel_size", 1),  # the cost model's
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "pp_stage_layers": list(config.pp_stage_layers) if config.pp_stage_layers else None,
        "acceptance_rate": args.acceptance_rate,
        "seed": args.seed,
    }


def result_json(args, trace, config, cost, sim, wall: float) -> dict:
    """bench serve's result keys for the simulated run, and the engine simulated."""
    from jaxllm.bench.serve import parse_goodput, parse_percentiles

    return {
        **engine_json(args, trace, config, cost),
        "simulation_seconds": wall,
        **sim.to_json(
            goodput=parse_goodput(args.goodput) or None, percentiles=parse_percentiles(args.metric_percentiles)
        ),
    }


def print_summary(args, result: dict, config, cost, sim) -> None:
    from jaxllm.bench.results import format_result
    from jaxllm.sim.coverage import failure_line

    print(format_result(result, title="Simulated Serving Result"))
    print(engine_summary(args, result, cost.engine))
    failed = failure_line([r.error for r in sim.records])
    if failed:
        print(failed)
    print(
        f"{sim.num_steps} steps, {sim.num_preemptions} preemptions, prefix-cache hit rate "
        f"{sim.prefix_cache_hit_rate:.1%}, mean KV usage {result['mean_kv_cache_usage']:.1%}; "
        f"simulated in {result['simulation_seconds']:.2f} s"
    )
    if config.speculative is not None:
        print(speculation_line(result))
    if config.pipeline_parallel_size > 1:
        print(pipeline_line(result))


def save(args, result: dict, sim) -> None:
    """--output's JSON (with per-request arrays) and --plot's PNGs."""
    from jaxllm.bench.results import per_request

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
        title = f"{result['scheduling_policy']} (simulated)"
        paths.append(plot_kv_usage(sim, Path(args.plot) / "kv_cache_usage.png", title=title))
        print("plots:", ", ".join(str(p) for p in paths))


def engine_summary(args, result: dict, engine: dict) -> str:
    """The engine settings simulated, which flags gave, and those beyond the calibrated shapes."""
    from jaxllm.sim.coverage import engine_line

    names = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching")
    settings: dict[str, object] = {name: result[name] for name in names}
    settings["num_blocks"] = result["num_blocks"]
    settings["scheduling_policy"] = result["scheduling_policy"]
    given = {name for name in (*ENGINE_FLAGS, "enable_prefix_caching") if getattr(args, name) is not None}
    if "num_gpu_blocks_override" in given:
        given = (given - {"num_gpu_blocks_override"}) | {"num_blocks"}
    if args.scheduling_policy != "fcfs":
        given.add("scheduling_policy")
    return engine_line(settings, given, engine)


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


def pipeline_line(result: dict) -> str:
    """The summary's pipeline figures."""
    if result["pp_bubble_fraction"] is None:
        return "pipeline: no batch ran"
    layers = result["pp_stage_layers"]
    split = f"layers {layers}" if layers else "an even split"
    utilization = ", ".join(f"{u:.1%}" for u in result["pp_stage_utilization"] if u is not None)
    return (
        f"pipeline: {result['pipeline_parallel_size']} stages ({split}), {result['num_blocks']} KV blocks; bubble "
        f"{result['pp_bubble_fraction']:.1%} of the stages' time while busy, "
        f"{result['pp_mean_batches_in_flight']:.2f} batches in flight on average; stages busy {utilization}"
    )

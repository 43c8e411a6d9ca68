"""`jaxllm tune TRACE --cost COST.json --goodput ttft:MS tpot:MS`: pick engine settings for a workload and its
SLOs in the simulator, optionally confirm the top ones on a real server (docs/tuning.md)."""

from __future__ import annotations

import logging
import time

from jaxllm.engine.args import EngineArgs

logger = logging.getLogger("jaxllm.tune")


def register(sub) -> None:
    parser = sub.add_parser("tune", help="search engine settings for a trace and its SLOs in the simulator")
    parser.add_argument("trace", help="JSONL trace (see `jaxllm trace synth`); its arrivals are scaled in time")
    parser.add_argument("--cost", required=True, metavar="FILE", help="cost model from `jaxllm calibrate`")
    parser.add_argument(
        "--goodput",
        nargs="+",
        required=True,
        metavar="KEY:MS",
        help="SLOs as `jaxllm bench serve --goodput`: ttft:MS tpot:MS [e2el:MS]",
    )
    parser.add_argument(
        "--goodput-fraction",
        type=float,
        default=0.99,
        help="a rate is sustainable when at least this fraction of requests meets every SLO (default 0.99)",
    )
    parser.add_argument(
        "--search",
        nargs="+",
        default=None,
        metavar="NAME=V1,V2,...",
        help="engine arguments to search and their values, e.g. max_num_seqs=2,4,8 scheduling_policy=fcfs,sjf "
        "(default: max_num_seqs, max_num_batched_tokens and scheduling_policy within what the cost model covers)",
    )
    parser.add_argument("--full-grid", action="store_true", help="simulate every setting (default: coarse + refine)")
    parser.add_argument(
        "--validate",
        type=int,
        default=0,
        metavar="K",
        help="serve the top K settings for real and replay the trace; the winner by the measured figures",
    )
    parser.add_argument("--output", default=None, metavar="FILE", help="write the result JSON here")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write the rate and latency trade-off PNGs here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args) -> dict:
    from jaxllm.bench.serve import parse_goodput
    from jaxllm.sim.costmodel import CostModel
    from jaxllm.sim.trace import load_trace
    from jaxllm.tune import report
    from jaxllm.tune.capacity import MAX_DOUBLINGS, Objective
    from jaxllm.tune.search import Candidate, search
    from jaxllm.tune.space import (
        SEARCHABLE,
        base_engine_args,
        build_space,
        machine_differences,
        parse_search,
        with_setting,
    )
    from jaxllm.tune.validate import measured_winner, validate

    slos = parse_goodput(args.goodput)
    if args.validate < 0:
        raise ValueError(f"--validate must be >= 0, got {args.validate}")
    explicit = parse_search(args.search)
    cost = CostModel.load(args.cost)
    trace = load_trace(args.trace)
    if not trace:
        raise ValueError(f"{args.trace}: the trace is empty")
    given = EngineArgs.from_cli_args(args)
    differences = machine_differences(cost, given)
    for line in differences:
        logger.warning("the cost model was calibrated elsewhere: %s (predictions may not hold here)", line)
    base = base_engine_args(given, cost)
    space = build_space(explicit, cost, trace, {name: getattr(given, name) for name in SEARCHABLE})
    objective = Objective(trace, cost, slos, args.goodput_fraction, seed=args.seed)

    def evaluate(setting: dict) -> Candidate | None:
        engine = with_setting(base, setting)
        tokens, seqs = engine.max_num_batched_tokens, engine.max_num_seqs
        assert tokens is not None and seqs is not None  # base_engine_args fills them
        if tokens < seqs:  # the engine refuses it
            return None
        return Candidate(setting, engine, objective.capacity(engine))

    print(
        f"Tuning {len(trace)} requests at {objective.rate:.2f} req/s ({args.trace}), SLOs "
        f"{' '.join(f'{k}:{v:g}' for k, v in slos.items())} ms for {args.goodput_fraction:.0%} of requests; "
        f"space {space.size} settings: " + ", ".join(f"{k}={v}" for k, v in space.values.items()),
        flush=True,
    )
    started = time.perf_counter()
    candidates = search(space, evaluate, full=args.full_grid, progress=not args.disable_tqdm)
    seconds = time.perf_counter() - started
    if not candidates:
        raise ValueError("no setting in the space is one the engine accepts (max_num_batched_tokens >= max_num_seqs)")
    if candidates[0].max_request_rate == 0:
        raise ValueError(unmeetable(candidates, objective.rate / 2**MAX_DOUBLINGS, args.goodput_fraction))
    print(report.table(candidates, slos))
    print(
        f"{len(candidates)} settings of {space.size} tried, {objective.simulations} simulations in {seconds:.1f} s"
        + ("; search restricted: " + "; ".join(space.restricted) if space.restricted else "")
    )
    best = candidates[0]
    rows = None
    if args.validate:
        rows = validate(candidates, trace, slos, args.validate, seed=args.seed)
        print(report.validation_table(rows))
        best = candidates[measured_winner(rows)]
    result = {
        "trace": args.trace,
        "num_requests": len(trace),
        "trace_request_rate": objective.rate,
        "cost_model": args.cost,
        "goodput_slos_ms": slos,
        "goodput_fraction": args.goodput_fraction,
        "cost_model_differences": differences,
        "search": {
            "space": space.values,
            "restricted": space.restricted,
            "full_grid": args.full_grid,
            "grid_size": space.size,
            "settings_tried": len(candidates),
            "simulations": objective.simulations,
            "seconds": seconds,
        },
        "candidates": [report.candidate_json(c) for c in candidates],
        "best": report.engine_args_dict(best.args),
        "best_setting": best.setting,
        "chosen_by": "measured" if rows else "predicted",
        "predicted": {
            **best.capacity.at_trace.summary,
            "goodput_fraction": best.capacity.at_trace.fraction,
            "max_request_rate": best.max_request_rate,
        },
        "validated": rows,
        "command": report.serve_command(best.args),
    }
    print(f"best ({result['chosen_by']}): {report.short(best.setting)}, {best.max_request_rate:.2f} req/s sustainable")
    print("serve it with:", result["command"])
    if args.plot:
        print("plots:", ", ".join(str(p) for p in report.save_plots(candidates, slos, args.plot)))
    if args.output:
        report.write_json(result, args.output)
        print(f"result JSON: {args.output}")
    return result


def unmeetable(candidates, lowest_rate: float, fraction: float) -> str:
    """No setting meets the SLOs at any rate: the closest one and by how much it misses, at the lowest rate."""
    from jaxllm.tune.report import short

    def worst(c) -> float:
        misses = c.capacity.lowest.misses
        return float("inf") if misses.get("failed") else max(v for k, v in misses.items() if k != "failed")

    closest = min(candidates, key=lambda c: (worst(c), c.rank_key()))
    lowest = closest.capacity.lowest
    q = f"p{100 * fraction:g}"
    misses = ", ".join(
        f"{q} {k.upper()} {v:.2f}x its SLO ({v - 1:+.0%})" for k, v in lowest.misses.items() if k != "failed" and v > 1
    )
    failed = lowest.misses.get("failed")
    return (
        f"no setting meets the SLOs for {fraction:.0%} of the requests at any rate tried (down to "
        f"{lowest_rate:.4g} req/s, each request nearly alone); the closest, {short(closest.setting)}, serves "
        f"{lowest.fraction:.1%} of them within every SLO: {misses or 'within the SLOs at the quantile'}"
        + (f"; {failed:g} requests failed (too long for max_model_len?)" if failed else "")
    )

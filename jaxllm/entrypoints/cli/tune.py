"""`jaxllm tune TRACE --cost COST.json --goodput ttft:MS tpot:MS`: pick engine settings for a workload and its
SLOs in the simulator, optionally confirm the top ones on a real server (docs/tuning.md). With `--max-rate`: for
the one setting the engine flags give, the highest Poisson request rate at which the SLOs hold."""

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
        "--max-rate",
        action="store_true",
        help="no search: the highest Poisson request rate at which the setting the engine flags give meets the "
        "SLOs (the trace's requests at seeded Poisson arrivals, as `jaxllm bench serve --request-rate R --seed S`)",
    )
    parser.add_argument(
        "--acceptance-rate",
        type=float,
        default=None,
        metavar="RATE",
        help="n-gram speculation: chance a draft is accepted given the one before it was, for requests whose trace "
        "record carries none (as `jaxllm simulate`'s); with it the default space searches speculation depth",
    )
    parser.add_argument(
        "--validate",
        type=int,
        default=0,
        metavar="K",
        help="serve the top K settings for real and replay the trace; the winner by the measured figures "
        "(with --max-rate: 1 serves the setting at the rate found)",
    )
    parser.add_argument("--output", default=None, metavar="FILE", help="write the result JSON here")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write the rate and latency trade-off PNGs here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args) -> dict:
    from jaxllm.bench.serve import parse_goodput
    from jaxllm.sim.costmodel import CostModel
    from jaxllm.sim.coverage import FROM_COST_MODEL, check_trace_fits
    from jaxllm.sim.trace import load_trace
    from jaxllm.tune import report
    from jaxllm.tune.capacity import MAX_DOUBLINGS, Objective
    from jaxllm.tune.search import Candidate, search
    from jaxllm.tune.space import (
        SEARCHABLE,
        SPECULATION,
        base_engine_args,
        build_space,
        machine_differences,
        parse_search,
        speculation_depth,
        with_setting,
    )
    from jaxllm.tune.validate import measured_winner, validate

    slos = parse_goodput(args.goodput)
    if args.validate < 0:
        raise ValueError(f"--validate must be >= 0, got {args.validate}")
    if args.acceptance_rate is not None and not 0 <= args.acceptance_rate <= 1:
        raise ValueError(f"--acceptance-rate must be in [0, 1], got {args.acceptance_rate}")
    if args.max_rate:
        for flag, given_flag in (("--search", args.search), ("--full-grid", args.full_grid), ("--plot", args.plot)):
            if given_flag:
                raise ValueError(f"--max-rate takes one setting, given by engine flags: leave out {flag}")
        if args.validate > 1:
            raise ValueError(f"--max-rate --validate serves its one setting: 1, not {args.validate}")
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
    assert base.max_model_len is not None  # base_engine_args fills it
    source = "--max-model-len" if given.max_model_len is not None else FROM_COST_MODEL
    check_trace_fits(trace, base.max_model_len, cost.engine, source=source, cost_path=args.cost)
    acceptance_known = args.acceptance_rate is not None or all(r.acceptance_rate is not None for r in trace)
    if args.max_rate:
        return max_rate(args, trace, cost, slos, base, differences, acceptance_known)
    fixed = {name: getattr(given, name, None) for name in SEARCHABLE}
    fixed[SPECULATION] = speculation_depth(given) if given.speculative_config is not None else None
    space = build_space(explicit, cost, trace, fixed, acceptance_known=acceptance_known)
    if (any(space.values.get(SPECULATION, [])) or base.speculative_config is not None) and not acceptance_known:
        raise ValueError(NO_ACCEPTANCE)
    objective = Objective(
        trace, cost, slos, args.goodput_fraction, seed=args.seed, acceptance_rate=args.acceptance_rate
    )

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
        f"max_model_len {base.max_model_len}; space {space.size} settings: "
        + ", ".join(f"{k}={v}" for k, v in space.values.items()),
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
        **common_json(args, trace, slos, differences),
        "trace_request_rate": objective.rate,
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
    finish(args, result)
    return result


NO_ACCEPTANCE = (
    "speculation needs an acceptance rate: give --acceptance-rate, or a trace whose records carry acceptance_rate "
    "(`jaxllm trace synth --acceptance-rate`)"
)


def common_json(args, trace, slos: dict[str, float], differences: list[str]) -> dict:
    """The keys every tune result starts with: the workload, the cost model, the SLOs."""
    return {
        "trace": args.trace,
        "num_requests": len(trace),
        "cost_model": args.cost,
        "goodput_slos_ms": slos,
        "goodput_fraction": args.goodput_fraction,
        "acceptance_rate": args.acceptance_rate,
        "cost_model_differences": differences,
    }


def finish(args, result: dict) -> None:
    if args.output:
        from jaxllm.tune.report import write_json

        write_json(result, args.output)
        print(f"result JSON: {args.output}")


def max_rate(args, trace, cost, slos: dict[str, float], base: EngineArgs, differences, acceptance_known) -> dict:
    """`--max-rate`: the setting's highest sustainable Poisson request rate, by the capacity search's bisection on a
    seeded Poisson process (`capacity.poisson`); with `--validate`, served at that rate and compared."""
    from jaxllm.sim.trace import TraceRequest
    from jaxllm.tune import report
    from jaxllm.tune.capacity import MAX_DOUBLINGS, STEPS_PER_DOUBLING, Objective, poisson, scaled, trace_rate
    from jaxllm.tune.search import Candidate
    from jaxllm.tune.space import SEARCHABLE, SPECULATION, speculation_depth
    from jaxllm.tune.validate import measure, side_by_side

    if base.speculative_config is not None and not acceptance_known:
        raise ValueError(NO_ACCEPTANCE)
    if base.max_num_batched_tokens < base.max_num_seqs:  # type: ignore[operator]  # base_engine_args fills them
        raise ValueError("max_num_batched_tokens must be >= max_num_seqs (the engine refuses it)")
    try:  # the grid starts at the trace's own rate; a trace arriving at once starts at 1 req/s
        start = trace_rate(trace)
    except ValueError:
        start = 1.0
    arrivals = poisson(trace, start, args.seed)
    objective = Objective(
        arrivals, cost, slos, args.goodput_fraction, seed=args.seed, rate=start, acceptance_rate=args.acceptance_rate
    )
    # the setting: the default space's arguments, and the other searchable ones where not at their defaults
    setting = {name: getattr(base, name) for name in ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy")}
    defaults = EngineArgs()
    for name in SEARCHABLE:
        if name not in setting and name != "kv_cache_memory_bytes" and hasattr(base, name):
            if getattr(base, name) != getattr(defaults, name):
                setting[name] = getattr(base, name)
    if speculation_depth(base):
        setting[SPECULATION] = speculation_depth(base)
    print(
        f"Highest Poisson rate for {report.short(setting)}: {len(trace)} requests ({args.trace}), SLOs "
        f"{' '.join(f'{k}:{v:g}' for k, v in slos.items())} ms for {args.goodput_fraction:.0%} of requests; "
        f"bisection from {start:.3g} req/s (seed {args.seed})",
        flush=True,
    )
    started = time.perf_counter()
    capacity = objective.capacity(base)
    seconds = time.perf_counter() - started
    candidate = Candidate(setting, base, capacity)
    if capacity.k is None or capacity.at_max is None:
        raise ValueError(unmeetable([candidate], start / 2**MAX_DOUBLINGS, args.goodput_fraction))
    rate, at_max = capacity.max_request_rate, capacity.at_max
    above = capacity.k + 1 if capacity.k + 1 in capacity.fractions else None
    rates = [
        {"request_rate": objective.rate_at(k), "goodput_fraction": f, "sustainable": f >= args.goodput_fraction}
        for k, f in capacity.fractions.items()
    ]
    predicted = {**at_max.summary, "goodput_fraction": at_max.fraction, "max_request_rate": rate}
    served: list[TraceRequest] = scaled(arrivals, 2 ** (capacity.k / STEPS_PER_DOUBLING))
    bench = (
        f"jaxllm bench serve --dataset-name jsonl --dataset-path {args.trace} --request-rate {rate!r} "
        f"--seed {args.seed} --goodput " + " ".join(f"{k}:{v:g}" for k, v in slos.items())
    )
    print(
        f"max sustainable Poisson rate: {rate:.3f} req/s"
        + (f" (fails at {objective.rate_at(above):.3f})" if above is not None else " (the top of the grid)")
        + f"; {objective.simulations} simulations in {seconds:.2f} s; at it (predicted): "
        f"goodput {at_max.fraction:.1%}, "
        f"mean TTFT {at_max.summary['mean_ttft_ms']:.1f} ms, mean TPOT {at_max.summary['mean_tpot_ms']:.1f} ms"
    )
    validated = None
    if args.validate:
        measured = measure(candidate, served, slos, seed=args.seed)
        validated = {
            "request_rate": rate,
            "compared": side_by_side(predicted, measured),
            "measured": measured,
            "slos_hold": measured["goodput_fraction"] >= args.goodput_fraction,
        }
        print(report.validation_table([{"setting": setting, **validated}]))
        print(
            f"measured at {rate:.3f} req/s: {measured['goodput_fraction']:.1%} of requests within every SLO "
            f"({'holds' if validated['slos_hold'] else 'does not hold'}: {args.goodput_fraction:.0%} asked)"
        )
    result = {
        **common_json(args, trace, slos, differences),
        "arrivals": {"process": "poisson", "seed": args.seed, "start_rate": start},
        "setting": setting,
        "engine_args": report.engine_args_dict(base),
        "max_request_rate": rate,
        # the next rate on the grid, which failed (None: the top of the grid held)
        "max_request_rate_below": objective.rate_at(above) if above is not None else None,
        "rates": rates,
        "slo_attainment": at_max.misses,
        "predicted": predicted,
        "validated": validated,
        "search": {"simulations": objective.simulations, "seconds": seconds},
        "command": report.serve_command(base),
        "bench_command": bench,
    }
    finish(args, result)
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
        + (f"; {failed:g} requests failed" if failed else "")
    )

"""`jaxllm tune TRACE --cost COST.json --goodput ttft:MS tpot:MS`: pick engine settings for a workload and its
SLOs in the simulator, optionally confirm the top ones on a real server (docs/tuning.md). With `--max-rate`: for
the one setting the engine flags give, the highest Poisson request rate at which the SLOs hold."""

from __future__ import annotations

from jaxllm.engine.args import EngineArgs


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
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        metavar="N",
        help="N equal instances behind `jaxllm router`, the trace being the cluster's: the router's policy is "
        "searched too (router=round_robin,least_loaded,session,prefix_aware; narrow it with --search router=...)",
    )
    parser.add_argument("--output", default=None, metavar="FILE", help="write the result JSON here")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write the rate and latency trade-off PNGs here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args) -> dict:
    from jaxllm.bench.serve import parse_goodput
    from jaxllm.tune.job import TuneJob
    from jaxllm.tune.max_rate import max_rate
    from jaxllm.tune.space import parse_search
    from jaxllm.tune.tuner import tune

    job = TuneJob(
        trace=args.trace,
        cost=args.cost,
        slos=parse_goodput(args.goodput),
        engine=EngineArgs.from_cli_args(args),
        goodput_fraction=args.goodput_fraction,
        acceptance_rate=args.acceptance_rate,
        validate=args.validate,
        seed=args.seed,
        output=args.output,
        instances=args.instances,
    )
    if args.max_rate:
        if args.instances > 1:
            raise ValueError("--max-rate finds one instance's rate: leave out --instances (or search with it)")
        for flag, given_flag in (("--search", args.search), ("--full-grid", args.full_grid), ("--plot", args.plot)):
            if given_flag:
                raise ValueError(f"--max-rate takes one setting, given by engine flags: leave out {flag}")
        if args.validate > 1:
            raise ValueError(f"--max-rate --validate serves its one setting: 1, not {args.validate}")
        return max_rate(job)
    explicit = parse_search(args.search)
    return tune(job, explicit, full_grid=args.full_grid, plot=args.plot, progress=not args.disable_tqdm)

"""`jaxllm trace synth`: write a synthetic request trace (JSONL) for `jaxllm simulate` and `jaxllm bench serve`."""

from __future__ import annotations

from jaxllm.entrypoints.cli.common import Parser


def register(sub) -> None:
    trace = sub.add_parser("trace", help="request traces: synth")
    kinds = trace.add_subparsers(dest="trace_command", required=True, parser_class=Parser)
    synth = kinds.add_parser("synth", help="write a synthetic trace: arrivals, lengths, tenants, shared prefixes")
    synth.add_argument("--out", required=True, metavar="FILE", help="the JSONL trace to write")
    synth.add_argument("--num-requests", type=int, default=1000)
    synth.add_argument("--seed", type=int, default=0)
    arrivals = synth.add_argument_group("arrivals")
    arrivals.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests per second (default inf: all at time 0)"
    )
    arrivals.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 is Poisson, below 1 burstier (vLLM's --burstiness)",
    )
    lengths = synth.add_argument_group("lengths")
    from jaxllm.sim.synth import DISTRIBUTIONS

    for which, mean in (("input", 256), ("output", 128)):
        lengths.add_argument(f"--{which}-len", type=int, default=mean, help=f"mean {which} length (tokens)")
        lengths.add_argument(f"--{which}-dist", choices=DISTRIBUTIONS, default="uniform")
        lengths.add_argument(f"--max-{which}-len", type=int, default=None, help=f"clip {which} lengths here")
    lengths.add_argument("--range-ratio", type=float, default=0.5, help="uniform: mean·[1-r, 1+r]")
    lengths.add_argument("--sigma", type=float, default=1.0, help="lognormal: spread in log space")
    mix = synth.add_argument_group("prefixes, tenants, priorities")
    mix.add_argument(
        "--num-prefix-groups",
        type=int,
        default=0,
        help="requests share one of this many prefixes (their prompt: prefix + input-len tokens)",
    )
    mix.add_argument("--prefix-len", type=int, default=0, help="shared prefix length (tokens)")
    mix.add_argument("--num-users", type=int, default=0, help="tenants (the `user` field)")
    mix.add_argument("--user-skew", type=float, default=0.0, help="Zipf exponent of tenant shares (0: equal)")
    mix.add_argument("--num-priorities", type=int, default=1, help="priorities drawn from 0..N-1")
    mix.add_argument(
        "--acceptance-rate",
        default=None,
        metavar="RATE|LOW:HIGH",
        help="speculative decoding (jaxllm simulate): each request's draft acceptance rate, or a range each "
        "request's is drawn from uniformly",
    )
    chat = synth.add_argument_group("conversations (multi-turn: a session's turns extend one another)")
    chat.add_argument(
        "--turns",
        type=int,
        default=1,
        metavar="N",
        help="requests per conversation (>1: multi-turn; --request-rate is then conversations per second, "
        "--input-len each turn's new message, --max-input-len where a conversation stops)",
    )
    chat.add_argument("--think-time", type=float, default=5.0, metavar="S", help="mean seconds between two turns")
    synth.set_defaults(func=run_synth)


def parse_acceptance_rate(value: str | None) -> float | tuple[float, float] | None:
    """`0.7` or `0.3:0.9` (a range), or None."""
    if value is None:
        return None
    try:
        parts = [float(p) for p in value.split(":")]
    except ValueError:
        raise ValueError(f"--acceptance-rate takes RATE or LOW:HIGH (numbers in [0, 1]), got {value!r}") from None
    if len(parts) > 2 or not all(0 <= p <= 1 for p in parts):
        raise ValueError(f"--acceptance-rate takes RATE or LOW:HIGH (numbers in [0, 1]), got {value!r}")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def run_synth(args) -> None:
    from jaxllm.sim.synth import LengthDist, conversations, synthesize
    from jaxllm.sim.trace import save_trace

    def dist(which: str) -> LengthDist:
        return LengthDist(
            getattr(args, f"{which}_len"),
            getattr(args, f"{which}_dist"),
            args.range_ratio,
            args.sigma,
            maximum=getattr(args, f"max_{which}_len"),
        )

    if args.turns > 1:
        if args.num_users or args.num_priorities > 1 or args.acceptance_rate is not None:
            raise ValueError("--turns > 1 takes no --num-users, --num-priorities or --acceptance-rate")
        trace = conversations(
            -(-args.num_requests // args.turns),
            args.turns,
            request_rate=args.request_rate,
            turn_len=dist("input"),
            output_len=dist("output"),
            think_time_s=args.think_time,
            num_prefix_groups=args.num_prefix_groups,
            prefix_len=args.prefix_len,
            max_prompt_len=args.max_input_len,
            seed=args.seed,
        )[: args.num_requests]
        save_trace(trace, args.out)
        print(f"wrote {len(trace)} requests over {trace[-1].arrival_time:.1f} s to {args.out}")
        return
    if args.turns < 1:
        raise ValueError(f"--turns must be >= 1, got {args.turns}")
    trace = synthesize(
        args.num_requests,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        input_len=dist("input"),
        output_len=dist("output"),
        num_prefix_groups=args.num_prefix_groups,
        prefix_len=args.prefix_len,
        num_users=args.num_users,
        user_skew=args.user_skew,
        num_priorities=args.num_priorities,
        acceptance_rate=parse_acceptance_rate(args.acceptance_rate),
        seed=args.seed,
    )
    save_trace(trace, args.out)
    span = trace[-1].arrival_time
    print(f"wrote {len(trace)} requests over {span:.1f} s to {args.out}")

"""`jaxllm router`: one OpenAI-compatible API in front of `jaxllm serve` processes.

Two modes. `--prefill URL... --decode URL...`: disaggregated prefill and decode instances, as vLLM's P/D proxy
(each request prefilled on the least-loaded prefill instance, generated on the least-loaded decode instance;
docs/disaggregated.md). `--instances URL... --policy NAME`: N equal instances, a routing policy choosing each
request's (round_robin, least_loaded, session, prefix_aware, or a dotted path to a user's class; docs/scaling.md).
"""

from __future__ import annotations

POLICY_NAMES = "round_robin, least_loaded, session, prefix_aware"


def register(sub) -> None:
    router = sub.add_parser(
        "router", help="front disaggregated prefill and decode instances, or N equal instances, with one OpenAI API"
    )
    router.add_argument(
        "--prefill",
        nargs="+",
        metavar="URL",
        help="the prefill instances' base URLs (http://host:port); if none answers, decode instances prefill",
    )
    router.add_argument("--decode", nargs="+", metavar="URL", help="the decode instances' base URLs (http://host:port)")
    router.add_argument(
        "--instances", nargs="+", metavar="URL", help="N equal instances' base URLs, routed by --policy (not with P/D)"
    )
    router.add_argument(
        "--policy",
        default="round_robin",
        metavar="NAME",
        help=f"with --instances: {POLICY_NAMES}, or a dotted path to a jaxllm.routing.base.RoutingPolicy subclass",
    )
    router.add_argument(
        "--kv-events",
        nargs="+",
        metavar="ENDPOINT",
        help="with --instances: each instance's KV events, in order (tcp://host:5557[,tcp://host:5558 replay]); "
        "default: what each instance's /v1/kv_cache_info says",
    )
    router.add_argument(
        "--health-check-interval",
        type=float,
        default=2.0,
        help="seconds between checks of each instance's /health and load; a failed check takes it out of rotation",
    )
    router.add_argument(
        "--session-header", default="x-session-id", help="session policy: the header naming a session (else `user`)"
    )
    router.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=32,
        help="prefix_aware: route by load alone while max - min running+waiting exceeds this ...",
    )
    router.add_argument(
        "--balance-rel-threshold", type=float, default=1.0001, help="prefix_aware: ... and max exceeds this x min"
    )
    router.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait on an instance: for each read of its answer (a non-streamed completion: the "
        "whole generation); connecting gets at most 5",
    )
    router.set_defaults(func=run)


def build(args):
    """The app the flags describe; a bad combination is a ValueError in one line (before anything listens)."""
    from jaxllm.entrypoints.router.app import build_app, build_balanced_app

    if args.instances:
        if args.prefill or args.decode:
            raise ValueError("--instances is for equal instances; it does not go with --prefill/--decode")
        options = {}
        if args.policy == "prefix_aware":
            options = {
                "balance_abs_threshold": args.balance_abs_threshold,
                "balance_rel_threshold": args.balance_rel_threshold,
            }
        return build_balanced_app(
            args.instances,
            policy=args.policy,
            policy_options=options,
            kv_events=args.kv_events,
            health_check_interval=args.health_check_interval,
            session_header=args.session_header,
            timeout=args.timeout,
        )
    if not args.prefill or not args.decode:
        raise ValueError("name --instances URL..., or both --prefill URL... and --decode URL...")
    if args.kv_events or args.policy != "round_robin":
        raise ValueError("--policy and --kv-events go with --instances")
    return build_app(args.prefill, args.decode, timeout=args.timeout)


def run(args) -> None:
    import uvicorn

    from jaxllm.entrypoints.openai.launcher import BoundServer, create_server_socket

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    app = build(args)  # checks the flags, loads nothing
    sock = create_server_socket(args.host, args.port)  # a port in use: one line, as `jaxllm serve`
    try:
        # a short graceful shutdown: open streams end when the instances' do, which may take minutes
        config = uvicorn.Config(app, log_level=args.log_level.lower(), timeout_graceful_shutdown=2)
        BoundServer(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C ends the router: exit 0, as uvicorn.run did
        pass
    finally:
        sock.close()

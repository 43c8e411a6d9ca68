"""`jaxllm router --prefill URL... --decode URL...`: one OpenAI-compatible API in front of
disaggregated prefill and decode instances (`jaxllm serve` processes), as vLLM's P/D proxy.

Each request is prefilled on the least-loaded prefill instance and generated on the least-loaded
decode instance; docs/disaggregated.md has the protocol and what happens when an instance fails.
"""

from __future__ import annotations


def register(sub) -> None:
    router = sub.add_parser(
        "router", help="front disaggregated prefill and decode instances with one OpenAI-compatible API"
    )
    router.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="the prefill instances' base URLs (http://host:port); if none answers, decode instances prefill",
    )
    router.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="the decode instances' base URLs (http://host:port)"
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


def run(args) -> None:
    import uvicorn

    from jaxllm.entrypoints.openai.launcher import BoundServer, create_server_socket
    from jaxllm.entrypoints.router.app import build_app

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    app = build_app(args.prefill, args.decode, timeout=args.timeout)  # checks the flags, loads nothing
    sock = create_server_socket(args.host, args.port)  # a port in use: one line, as `jaxllm serve`
    try:
        # a short graceful shutdown: open streams end when the instances' do, which may take minutes
        config = uvicorn.Config(app, log_level=args.log_level.lower(), timeout_graceful_shutdown=2)
        BoundServer(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C ends the router: exit 0, as uvicorn.run did
        pass
    finally:
        sock.close()

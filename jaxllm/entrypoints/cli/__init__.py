"""The `jaxllm` command: one module per subcommand, each with `register(subparsers)`.

Errors a user can fix (a bad flag, a bad prompt, a missing file) print one line and exit
with status 2; only bugs show a traceback.
"""

from __future__ import annotations

import importlib
import logging
import sys

from jaxllm.entrypoints.cli.common import Parser

SUBCOMMANDS = ("generate", "chat", "serve", "router", "convert", "bench", "trace", "calibrate", "simulate", "tune")


def build_parser() -> Parser:
    parser = Parser(prog="jaxllm", description="LLM inference and serving in JAX")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"jaxllm.entrypoints.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if getattr(args, "nnodes", 1) > 1:  # a multi-host node: its engine runs in a supervised child
            from jaxllm.distributed.supervisor import supervise

            status = supervise(args.node_rank, sys.argv[1:] if argv is None else argv)
            if status is not None:
                return status
        args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotImplementedError) as e:
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0

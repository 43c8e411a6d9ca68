"""The `jaxllm` command: one module per subcommand, each with `register(subparsers)`.

Errors a user can fix (a bad flag, a bad prompt, a missing file) print one line and exit
with status 2; only bugs show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from jaxllm.entrypoints.cli.common import Parser
from jaxllm.logger import LOG_LEVELS, configure_logging, log_level_in

SUBCOMMANDS = (
    "generate",
    "chat",
    "serve",
    "router",
    "convert",
    "bench",
    "trace",
    "calibrate",
    "simulate",
    "tune",
    "cache",
)
LOG_LEVEL_HELP = "jaxllm's log level (default INFO); DEBUG also shows other libraries' notices"


def build_parser() -> Parser:
    parser = Parser(prog="jaxllm", description="LLM inference and serving in JAX")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help=LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"jaxllm.entrypoints.cli.{name}").register(sub)
    _log_level_everywhere(parser)
    return parser


def _log_level_everywhere(parser: argparse.ArgumentParser) -> None:
    """`--log-level` after the subcommand too (`jaxllm generate --log-level WARNING hi`): each subcommand's
    parser takes it, with no default of its own, so that one given before the subcommand still holds."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if "--log-level" not in child._option_string_actions:
                    child.add_argument(
                        "--log-level",
                        default=argparse.SUPPRESS,
                        type=str.upper,
                        choices=LOG_LEVELS,
                        help=LOG_LEVEL_HELP,
                    )
                _log_level_everywhere(child)


def main(argv: list[str] | None = None) -> int:
    configure_logging(log_level_in(sys.argv[1:] if argv is None else argv) or "INFO")  # before any import quiets
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
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

"""`jaxllm bench NAME`: benchmarks with vLLM's names and JSON keys; each lives in `jaxllm/bench/NAME.py`.

A benchmark module has `add_cli_args(parser)`, `main(args)` and a docstring whose first
line is its help.
"""

from __future__ import annotations

import importlib

from jaxllm.entrypoints.cli.common import Parser

BENCHMARKS: tuple[str, ...] = ("serve", "throughput", "latency")  # modules of jaxllm.bench


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    kinds = bench.add_subparsers(dest="benchmark", required=True, parser_class=Parser)
    for name in BENCHMARKS:
        module = importlib.import_module(f"jaxllm.bench.{name}")
        parser = kinds.add_parser(name, help=(module.__doc__ or name).strip().splitlines()[0])
        module.add_cli_args(parser)
        parser.set_defaults(func=module.main)

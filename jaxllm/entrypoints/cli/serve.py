"""`jaxllm serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM`.

The port is bound before the engine is built, as vLLM does: one taken is an error before any loading.

SIGINT/SIGTERM: stop accepting connections, abort what is in flight (streams end with
finish_reason "abort"), let the responses finish, stop the engine, exit 0.
"""

from __future__ import annotations

import argparse
import json
import os

from jaxllm.engine.args import EngineArgs

TOOL_PARSER_NAMES = ("hermes",)  # jaxllm.entrypoints.openai.tool_parsers.TOOL_PARSERS (not imported: CLI start-up)


def register(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model path or HF repo (same as --model; default: SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("JAXLLM_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/* (default: $JAXLLM_API_KEY)",
    )
    serve.add_argument(
        "--served-model-name", nargs="+", default=None, help="the model name(s) clients use (default: the model's path)"
    )
    serve.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's prompt and sampling parameters (INFO; off by default: prompts are users' data)",
    )
    serve.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="with --enable-log-requests: log at most this many characters (and token ids) of each prompt",
    )
    serve.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    serve.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=5.0,
        help="seconds shutdown waits for responses to finish after aborting them",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="the chat template for every conversation, replacing the model's: a file, the template itself, "
        "or a shipped one by name (chatml_tools: ChatML with Hermes-style tool calls)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide whether to call a tool (tool_choice "auto"); needs --tool-call-parser '
        "(on by default for the default model)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSER_NAMES),
        help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>; the default model's)",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="refuse request bodies larger than this with a 413 (default 16 MiB; 0: no limit)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT checkpoints) to serve, each a model of its own named NAME, loaded at start-up "
        "(needs --enable-lora): NAME=PATH, or vLLM's JSON "
        '\'{"name": "x", "path": "/p", "base_model_name": "m"}\'; '
        "$JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=true also serves /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    serve.add_argument(
        "--disable-ui",
        action="store_true",
        help="no chat page at / and /ui (the API only)",
    )
    serve.add_argument(
        "--headless",
        action="store_true",
        help="multi-host follower (--node-rank > 0): no HTTP, only run node 0's steps",
    )
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(func=run)


def lora_module(value: str) -> tuple[str, str, str | None]:
    """One --lora-modules entry, `name=path` or vLLM's JSON form: (name, path, base_model_name)."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("name"), str)
            or not isinstance(entry.get("path"), str)
        ):
            raise argparse.ArgumentTypeError(
                f'expected {{"name": str, "path": str[, "base_model_name": str]}}: {value!r}'
            )
        unknown = set(entry) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown field(s) {', '.join(sorted(unknown))}: {value!r}")
        base = entry.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"base_model_name must be a string: {value!r}")
        name, path = entry["name"], entry["path"]
    else:
        name, sep, path = value.partition("=")
        base = None
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {value!r}")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"an adapter needs a name and a path, got {value!r}")
    return name, path, base


def run(args) -> None:
    from jaxllm.entrypoints.openai.launcher import create_server_socket, serve_http

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models named: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be 0 or more, got {args.max_log_len}")
    if args.max_request_body_bytes < 0:
        raise ValueError(f"--max-request-body-bytes must be 0 (no limit) or more, got {args.max_request_body_bytes}")
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.lora_modules and len({m[0] for m in args.lora_modules}) < len(args.lora_modules):
        raise ValueError("--lora-modules: two adapters of the same name")
    if args.headless != (args.node_rank > 0):
        raise ValueError("--headless goes with --node-rank > 0 (a follower), and every follower needs it")
    if args.headless:
        from jaxllm.entrypoints.cli.common import run_headless

        run_headless(EngineArgs.from_cli_args(args))
        return
    engine_args = EngineArgs.from_cli_args(args)
    sock = create_server_socket(args.host, args.port)  # before loading anything: a port in use fails now
    try:
        from jaxllm.engine.async_llm import AsyncLLM  # imports JAX: seconds
        from jaxllm.entrypoints.openai.api_server import build_app
        from jaxllm.entrypoints.openai.serving_models import LoRAModulePath

        engine = AsyncLLM.from_engine_args(
            engine_args,
            log_stats=not args.disable_log_stats,
            served_model_name=(args.served_model_name or [None])[0],
        )
        try:
            app = build_app(
                engine,
                served_model_names=args.served_model_name,
                api_key=args.api_key,
                enable_log_requests=args.enable_log_requests,
                max_log_len=args.max_log_len,
                chat_template=args.chat_template,
                enable_auto_tool_choice=args.enable_auto_tool_choice,
                tool_call_parser=args.tool_call_parser,
                max_request_body_bytes=args.max_request_body_bytes or None,
                lora_modules=[LoRAModulePath(*m) for m in args.lora_modules or []],
                disable_ui=args.disable_ui,
            )
        except BaseException:  # a bad --lora-modules (or other flag): stop the engine before saying why
            engine.shutdown()
            raise
        serve_http(
            app,
            engine,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=args.timeout_graceful_shutdown,
            sock=sock,
        )
    finally:
        sock.close()

"""The `jaxllm` command: generate, chat, convert.

Errors a user can fix (a bad flag, a bad prompt, a missing file) print one line and exit
with status 2; only bugs show a traceback.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys

from jaxllm.engine.args import EngineArgs


def _add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--min-tokens", type=int, default=0)
    group.add_argument("--n", type=int, default=1, help="samples per prompt")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (SamplingParams.seed)")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args):
    from jaxllm.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def _make_llm(args):
    from jaxllm.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    fields = {k: v for k, v in vars(engine_args).items() if k != "model"}
    return LLM(engine_args.model, **fields)


def cmd_generate(args) -> None:
    params = _sampling_params(args)  # validate before loading anything
    llm = _make_llm(args)
    tokenizer = llm.get_tokenizer()
    use_template = not args.no_chat_template and tokenizer is not None and tokenizer.chat_template
    if use_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        for completion in output.outputs:
            if len(output.outputs) > 1:
                print(f"--- sample {completion.index}")
            print(completion.text.strip() if use_template else prompt + completion.text)
        if len(args.prompts) > 1:
            print()


def cmd_chat(args) -> None:
    params = _sampling_params(args)
    llm = _make_llm(args)
    tokenizer = llm.get_tokenizer()
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("this model has no chat template")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    ids = itertools.count()
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        request_id = f"chat-{next(ids)}"
        llm.engine.add_request(request_id, tokenizer.encode(text, add_special_tokens=False), params)
        printed, reply = 0, ""
        while llm.engine.has_unfinished_requests():
            for output in llm.engine.step():
                reply = output.outputs[0].text
                print(reply[printed:], end="", flush=True)
                printed = len(reply)
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_convert(args) -> None:
    from jaxllm.entrypoints.convert import convert

    out = convert(args.source, args.out, dtype=args.dtype)
    print(f"wrote {out}")


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line naming the problem, not a usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxllm", description="LLM inference and serving in JAX")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text for prompts (chat-templated when the model has one)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--no-chat-template", action="store_true", help="complete the raw prompt text")
    EngineArgs.add_cli_args(gen)
    _add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    conv = sub.add_parser("convert", help="convert a model to an Orbax checkpoint under checkpoints/")
    conv.add_argument("source", nargs="?", default=None, help="GGUF file, HF directory (default: the default model)")
    conv.add_argument("--out", required=True, help="output folder, e.g. checkpoints/NAME")
    conv.add_argument("--dtype", default="auto")
    conv.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotImplementedError) as e:
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

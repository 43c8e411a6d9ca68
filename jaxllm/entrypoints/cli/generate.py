"""`jaxllm generate PROMPT...`: offline generation, chat-templated when the model has a template."""

from __future__ import annotations

from jaxllm.engine.args import EngineArgs
from jaxllm.entrypoints.cli.common import add_sampling_args, announce_start, encoded_prompts, make_llm, sampling_params


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for prompts (chat-templated when the model has one)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--no-chat-template", action="store_true", help="complete the raw prompt text")
    EngineArgs.add_cli_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=run)


def run(args) -> None:
    params = sampling_params(args)  # validate before loading anything
    if args.node_rank > 0:  # a multi-host follower runs node 0's steps and prints nothing
        from jaxllm.entrypoints.cli.common import run_headless

        run_headless(EngineArgs.from_cli_args(args))
        return
    announce_start(args)
    prompts, templated = encoded_prompts(args, args.prompts, chat=not args.no_chat_template)  # before loading
    outputs = make_llm(args).generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        for completion in output.outputs:
            if len(output.outputs) > 1:
                print(f"--- sample {completion.index}")
            print(completion.text.strip() if templated else prompt + completion.text)
        if len(args.prompts) > 1:
            print()

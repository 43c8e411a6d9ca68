"""What the subcommands share: the parser class, sampling flags, building an `LLM` from flags."""

from __future__ import annotations

import argparse
import logging

from jaxllm.engine.args import EngineArgs

logger = logging.getLogger("jaxllm")


class Parser(argparse.ArgumentParser):
    """Bad flags: one line naming the problem, not a usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
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


def sampling_params(args):
    from jaxllm.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def announce_start(args) -> None:
    """The first line of a start, before seconds of imports (JAX, transformers) and loading pass in silence (so
    nothing here imports them)."""
    logger.info("starting the engine for %s", args.model or "the default model")


def make_llm(args):
    from jaxllm.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    fields = {k: v for k, v in vars(engine_args).items() if k != "model"}
    return LLM(engine_args.model, **fields)


def encoded_prompts(args, texts: list[str], *, chat: bool) -> tuple[list[dict], bool]:
    """The prompts as token ids (chat-templated when `chat` and the model has a template), each checked against
    max_model_len before the weights load: the config and the tokenizer take about a second, the start tens of
    seconds. Returns the prompts as `LLM.generate` takes them, and whether the template applied."""
    from jaxllm.engine.startup import check_prompt
    from jaxllm.llm import chat_prompt
    from jaxllm.weights import open_model

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model_config()  # the cheap settings first
    source = open_model(engine_args.model, load_format=engine_args.load_format, dtype=engine_args.dtype)
    tokenizer = source.tokenizer(engine_args.tokenizer)
    if tokenizer is None:
        raise ValueError(f"{source.name} has no tokenizer: text prompts need one (--tokenizer)")
    templated = chat and bool(tokenizer.chat_template)
    max_model_len = engine_args.max_model_len or source.arch.max_position_embeddings
    prompts = []
    for i, text in enumerate(texts):
        prompt = (
            chat_prompt(tokenizer, [{"role": "user", "content": text}])
            if templated
            else {"prompt": text, "prompt_token_ids": tokenizer.encode(text)}
        )
        try:
            check_prompt(prompt["prompt_token_ids"], max_model_len, source.arch.vocab_size)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        prompts.append(prompt)
    return prompts, templated


def run_headless(engine_args: EngineArgs) -> int:
    """A multi-host follower (`--node-rank` > 0): build the same engine as node 0, then run its steps until it
    stops. Returns the steps run. (Here, above both: the step sync is below the engine core, as the runner is.)"""
    from jaxllm.distributed.step_sync import follow
    from jaxllm.engine.core import EngineCore

    core = EngineCore(engine_args, progress=False)
    return follow(core.runner, engine_args.distributed_timeout)

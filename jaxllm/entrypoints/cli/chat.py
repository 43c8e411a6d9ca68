"""`jaxllm chat`: an interactive chat that streams the reply token by token; `/reset` and `/exit` are commands,
never sent to the model."""

from __future__ import annotations

import itertools
import sys

from jaxllm.engine.args import EngineArgs
from jaxllm.entrypoints.cli.common import add_sampling_args, announce_start, make_llm, sampling_params


def register(sub) -> None:
    chat = sub.add_parser("chat", help="interactive chat, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=run)


def run(args) -> None:
    params = sampling_params(args)
    announce_start(args)
    llm = make_llm(args)
    from jaxllm.llm import chat_prompt  # after the start line: importing the engine takes seconds

    tokenizer = llm.get_tokenizer()
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("this model has no chat template")
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    ids = itertools.count()
    print("Chat with the model; /reset starts over, /exit (or an empty line, or Ctrl-D) ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        command = line.strip().lower()
        if command in ("", "/exit", "/quit"):
            break
        if command == "/reset":  # a new conversation: the system prompt stays
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command:
            print(f"unknown command {command}: /reset or /exit", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        request_id = f"chat-{next(ids)}"
        llm.engine.add_request(request_id, chat_prompt(tokenizer, messages)["prompt_token_ids"], params)
        printed, reply = 0, ""
        while llm.engine.has_unfinished_requests():
            for output in llm.engine.step():
                reply = output.outputs[0].text
                print(reply[printed:], end="", flush=True)
                printed = len(reply)
        print()
        messages.append({"role": "assistant", "content": reply})

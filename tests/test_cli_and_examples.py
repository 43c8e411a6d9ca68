"""The CLI and the examples, run as a user would run them."""

import os
import subprocess
import sys

import pytest

from tests.conftest import TEST_ENGINE, TEST_KV_BLOCKS, kv_bytes, serve_flags

ENGINE_FLAGS = serve_flags()


def jaxllm(*args, stdin=None):
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, input=stdin, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def test_generate_answers_on_the_default_model():
    result = jaxllm("generate", *ENGINE_FLAGS, "--max-tokens", "24", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "KV cache" in result.stderr and "executables) ready in" in result.stderr  # the one start-up line
    assert "starting the engine" in result.stderr.splitlines()[0]  # said before seconds of imports and loading


def test_chat_streams_a_reply_and_takes_reset_and_exit():
    """`/reset` starts over (greedy: the same question, the same reply), `/exit` ends; neither reaches the model."""
    question = "What is the capital of France?"
    stdin = f"{question}\n/reset\n{question}\n/exit\nnever answered\n"
    result = jaxllm("chat", *ENGINE_FLAGS, "--max-tokens", "24", stdin=stdin)
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.replace("> ", "\n").splitlines() if line.strip()]
    assert len(replies) == 2 and replies[0] == replies[1] and "Paris" in replies[0], result.stdout
    assert "conversation cleared" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--max-num-seqs", "banana", "hi"], "invalid int value: 'banana'"),
        (["generate", "--bogus-flag", "hi"], "unrecognized arguments: --bogus-flag"),
        (["generate"], "the following arguments are required: prompts"),
        (["generate", "--temperature", "-1", "hi"], "SamplingParams.temperature must be a number >= 0"),
        (["generate", "--dtype", "int8", "hi"], "argument --dtype: invalid choice: 'int8'"),
        (["generate", "--quantization", "default", "hi"], "argument --quantization: invalid choice: 'default'"),
        (["generate", "--model", "/nowhere/model.gguf", "hi"], "/nowhere/model.gguf"),
        (["generate", *ENGINE_FLAGS, "--no-chat-template", "word " * 600], "prompt 0: the prompt has 601 tokens"),
        (["generate", *ENGINE_FLAGS, "word " * 600], "more than max_model_len=512"),  # chat-templated
        (["generate", *ENGINE_FLAGS, "--kv-offloading-size", "1000000", "hi"], "more than this machine's"),
    ],
)
def test_bad_input_is_one_line_not_a_traceback(args, message):
    """Refused before the weights load or a step compiles (a user once waited 17-29 s for these)."""
    result = jaxllm(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Compiling" not in result.stderr and "loaded in" not in result.stderr


def test_help_names_every_quantization_and_auto_is_the_default():
    result = jaxllm("generate", "--help")
    assert "--quantization {auto,int8,int4,none}" in result.stdout
    assert "auto (the default" in " ".join(result.stdout.split())


def test_examples_run_on_the_default_model(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import chat
    import offline_inference

    engine = {**TEST_ENGINE, "kv_cache_memory_bytes": kv_bytes(TEST_KV_BLOCKS)}
    outputs = offline_inference.main(**engine)
    assert len(outputs) == 3 and "Paris" in outputs[0].outputs[0].text
    conversation = chat.main(**engine)
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert conversation[2]["content"] and conversation[4]["content"]
    assert "Q: What is the capital of France?" in capsys.readouterr().out

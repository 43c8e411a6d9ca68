"""Shared test set-up: JAX on CPU in float32, with enough host devices for sharding tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# the C++ kernels wherever they apply, as the self-check's "on": every test runs the same paths on every
# machine, whatever its timings say (tests/kernels/test_cpu_choice.py tests the self-check itself)
os.environ.setdefault("JAXLLM_CPU_KERNELS", "on")
# the quantized kernel's exact float-activation path: tests compare tokens with transformers; the integer path
# (x in 8 bits) has tests of its own (tests/test_int8_dot.py, tests/test_perplexity.py)
os.environ.setdefault("JAXLLM_CPU_INT8_DOT", "off")

import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """A crash (a segfault inside XLA, say) prints the crashing thread's stack alone: pytest's default, every
    thread's, buried it under a dozen idle workers' in the part of CI's output that is shown."""
    import faulthandler

    from _pytest.faulthandler import fault_handler_stderr_fd_key

    if fault_handler_stderr_fd_key in config.stash:
        faulthandler.enable(file=config.stash[fault_handler_stderr_fd_key], all_threads=False)


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model, loaded once per test session (float32, one device)."""
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.weights import load_model

    return load_model(None, mesh=make_mesh(), dtype="float32")


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' PyTorch model loading the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.weights.default import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


# Engine settings shared by the end-to-end tests: small buckets (16, 32, 64 tokens) so compiling
# is quick, and the same shapes everywhere so JAX's compilation cache serves every later engine.
TEST_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, dtype="float32", progress=False)
TEST_KV_BLOCKS = 256


def kv_bytes(num_blocks: int) -> int:
    """The KV budget for `num_blocks` blocks of the default model (float32, block size 16)."""
    return num_blocks * 2 * 30 * 16 * 3 * 64 * 4


def serve_flags(num_blocks: int = TEST_KV_BLOCKS) -> list[str]:
    """TEST_ENGINE's settings as `jaxllm serve` flags: the same compiled shapes as the offline tests."""
    flags = ["--dtype", TEST_ENGINE["dtype"], "--kv-cache-memory-bytes", str(kv_bytes(num_blocks))]
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        flags += ["--" + name.replace("_", "-"), str(TEST_ENGINE[name])]
    return flags


@pytest.fixture(scope="session")
def llm():
    """The default model behind the whole engine, shared by the end-to-end tests."""
    from jaxllm import LLM

    return LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(TEST_KV_BLOCKS))


@pytest.fixture(scope="session")
def server():
    """One OpenAI server (default model, TEST_ENGINE shapes) shared by the server test modules."""
    from tests.inprocess_server import InProcessServer

    s = InProcessServer()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

"""kv_cache_dtype="bfloat16" (vLLM's name) under the float32 default model: the engine runs end
to end, the cache holds twice the blocks for the same memory, and greedy tokens stay close to a
float32 cache (bfloat16 keys and values round the logits, so long continuations may drift)."""

import jax.numpy as jnp
import pytest

from jaxllm import LLM, SamplingParams
from tests.conftest import TEST_ENGINE, TEST_KV_BLOCKS, kv_bytes

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three prime numbers are", "Water boils at"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_llm():
    return LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(TEST_KV_BLOCKS), kv_cache_dtype="bfloat16")


def test_bfloat16_cache_runs_end_to_end(bf16_llm, llm):
    runner = bf16_llm.engine.runner
    assert runner.cache.k.dtype == jnp.bfloat16 and runner.cache.v.dtype == jnp.bfloat16
    assert runner.num_blocks == 2 * llm.engine.runner.num_blocks  # same bytes, half the size per block
    ours = bf16_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ref = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for o, r in zip(ours, ref, strict=True):
        got, want = o.outputs[0].token_ids, r.outputs[0].token_ids
        assert len(got) == GREEDY.max_tokens and o.outputs[0].finish_reason == "length"
        assert got[:4] == want[:4], (o.prompt, got, want)


def test_bad_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(**TEST_ENGINE, kv_cache_dtype="int3")

"""SamplingParams.prompt_logprobs and max_tokens=0 against transformers' log-softmax on the same tokens."""

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from tests.conftest import TEST_ENGINE
from tests.hf_reference import hf_log_softmax

# max_num_seqs=8 rows of logits a step: a prompt scores at most 8 positions a step (chunked prefill)
SHORT = "Paris is the capital of"  # one chunk
LONG = "The quick brown fox jumps over the lazy dog, and then it runs far away into the deep green forest where"


@pytest.fixture(scope="module")
def llm():
    return LLM(**TEST_ENGINE)


def check_against_transformers(output, hf_model, k):
    ids = output.prompt_token_ids
    ref = hf_log_softmax(hf_model, ids)
    entries = output.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for position in range(1, len(ids)):
        entry, expected = entries[position], ref[position - 1]
        token = ids[position]
        assert token in entry and len(entry) in (k, k + 1)
        assert abs(entry[token].logprob - expected[token]) < 2e-3, f"position {position}"
        assert (
            entry[token].rank == 1 + int((expected > expected[token] + 1e-4).sum())
            or abs(np.sort(expected)[::-1][entry[token].rank - 1] - expected[token]) < 1e-3
        )  # ranks agree but for near-ties
        top = sorted((t for t in entry if entry[t].rank <= k), key=lambda t: entry[t].rank)
        np.testing.assert_allclose([entry[t].logprob for t in top], np.sort(expected)[::-1][: len(top)], atol=2e-3)


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_prompt_logprobs_match_transformers(llm, hf_default_model, prompt):
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)
    assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    check_against_transformers(out, hf_default_model, 3)


def test_prompt_logprobs_with_a_prefix_cache_hit_and_a_sampled_token(llm, hf_default_model):
    greedy = SamplingParams(max_tokens=2, temperature=0)
    (plain,) = llm.generate(LONG, greedy, use_tqdm=False)  # fills the prefix cache
    (again,) = llm.generate(LONG, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0), use_tqdm=False)
    assert again.num_cached_tokens == 0  # every position is scored: nothing read from the cache
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids
    check_against_transformers(again, hf_default_model, 0)
    (cached,) = llm.generate(LONG, greedy, use_tqdm=False)
    assert cached.num_cached_tokens > 0 and cached.prompt_logprobs is None  # and it still filled the cache
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks


def test_prompt_logprobs_validation():
    for bad in (-1, 21, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)

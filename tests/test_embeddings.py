"""The pooling runner (runner="pooling"): embeddings equal transformers' final hidden states pooled the same way
(MEAN over chunked prefills, LAST), the pooler read from sentence-transformers files, batching invariance, KV
blocks back after the last chunk, no compile after warm-up, and the errors that name `runner`.

One pooling engine per pooler (module-scoped): the default model with LAST (its default) and MEAN, a tiny random
decoder whose sentence-transformers files ask for MEAN without normalisation.
"""

import json

import numpy as np
import pytest
import torch
import transformers

from jaxllm import LLM, SamplingParams
from jaxllm.pooling import PoolingParams
from jaxllm.runner.compilations import compilation_count
from tests.conftest import TEST_ENGINE, kv_bytes
from tests.tiny_models import CHUNKED_ENGINE, TINY_DECODER, random_model

POOLING = dict(TEST_ENGINE, runner="pooling", kv_cache_memory_bytes=kv_bytes(48))
rng = np.random.default_rng(5)
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 12  # ~170 tokens: three chunks of 64


def hf_pooled(model, token_ids, pooling: str, normalize: bool) -> np.ndarray:
    """transformers' `last_hidden_state` (after the final norm), pooled in float64."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([token_ids])).last_hidden_state[0].double().numpy()
    pooled = {"MEAN": hidden.mean(0), "LAST": hidden[-1], "CLS": hidden[0]}[pooling]
    return pooled / np.linalg.norm(pooled) if normalize else pooled


def assert_close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    cos = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cos >= 0.9999, cos
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.abs(want).max()))


@pytest.fixture(scope="module")
def last_llm():
    return LLM(**POOLING)


@pytest.fixture(scope="module")
def mean_llm():
    return LLM(**POOLING, pooler_config={"pooling_type": "MEAN", "normalize": False})


def test_default_model_last_equals_transformers(last_llm, hf_default_model):
    tokenizer = last_llm.get_tokenizer()
    prompts = ["Hello world", "Paris is the capital of", LONG]
    outputs = last_llm.embed(prompts, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids and out.finished
        assert len(out.outputs.embedding) == 576
        assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5  # vLLM's decoder default: LAST, normalised
        assert_close(out.outputs.embedding, hf_pooled(hf_default_model, ids, "LAST", True))


def test_default_model_mean_over_chunks_equals_transformers(mean_llm, hf_default_model):
    """MEAN over a prompt prefilled in three chunks (a running sum across them), beside short prompts."""
    tokenizer = mean_llm.get_tokenizer()
    prompts = [LONG, "Hi", "Embeddings are vectors."]
    assert len(tokenizer.encode(LONG)) > 2 * TEST_ENGINE["max_num_batched_tokens"]
    for prompt, out in zip(prompts, mean_llm.embed(prompts, use_tqdm=False), strict=True):
        assert_close(out.outputs.embedding, hf_pooled(hf_default_model, tokenizer.encode(prompt), "MEAN", False))


def test_batching_invariance_blocks_back_no_compile(last_llm):
    """An input embedded alone equals it in a batch of 64; every KV block is back after; nothing compiles."""
    prompts = [f"Sentence number {i} talks about {['cats', 'rivers', 'jax', 'tea'][i % 4]}." for i in range(64)]
    before = compilation_count()
    alone = last_llm.embed(prompts[17], use_tqdm=False)[0].outputs.embedding
    batch = last_llm.embed(prompts, use_tqdm=False)
    np.testing.assert_allclose(batch[17].outputs.embedding, alone, atol=1e-5)
    assert compilation_count() == before
    stats = last_llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_dimensions_normalize_and_score(last_llm):
    with pytest.raises(ValueError, match="Matryoshka"):
        last_llm.embed("x", PoolingParams(dimensions=32), use_tqdm=False)
    raw = last_llm.embed("a cat", PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    unit = last_llm.embed("a cat", use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(np.asarray(raw) / np.linalg.norm(raw), unit, atol=1e-5)
    scores = last_llm.score("a cat", ["a kitten", "a cat"], use_tqdm=False)
    assert len(scores) == 2 and abs(scores[1].outputs.score - 1) < 1e-5
    pairs = last_llm.score(["a", "b"], ["a", "c"], use_tqdm=False)
    assert abs(pairs[0].outputs.score - 1) < 1e-5
    with pytest.raises(ValueError, match="text_1 has 2"):
        last_llm.score(["a", "b"], ["a", "b", "c"], use_tqdm=False)


def test_runner_mismatch_names_runner(last_llm, llm):
    with pytest.raises(ValueError, match="runner='generate'"):
        last_llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_model_len"):
        last_llm.embed({"prompt_token_ids": [1] * (TEST_ENGINE["max_model_len"] + 1)}, use_tqdm=False)


def test_tiny_decoder_sentence_transformers_mean(tmp_path):
    """A model directory with sentence-transformers files (MEAN, no Normalize module): the engine reads its pooler;
    prompts in 16-token chunks beside each other equal transformers' mean; a Matryoshka config allows dimensions."""
    config = transformers.LlamaConfig(**TINY_DECODER, matryoshka_dimensions=[16, 64])
    config.architectures = ["LlamaForCausalLM"]
    model = random_model(transformers.LlamaForCausalLM, config).eval()
    model.save_pretrained(tmp_path)
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    llm = LLM(str(tmp_path), runner="pooling", **CHUNKED_ENGINE)
    assert llm.engine.config.pooler.pooling_type == "MEAN" and llm.engine.config.pooler.normalize is False
    prompts = [rng.integers(0, 96, int(n)).tolist() for n in (5, 40, 77, 16)]
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, out in zip(prompts, outputs, strict=True):
        assert_close(out.outputs.embedding, hf_pooled(model, p, "MEAN", False))
    short = llm.embed({"prompt_token_ids": prompts[1]}, PoolingParams(dimensions=16), use_tqdm=False)[0]
    want = hf_pooled(model, prompts[1], "MEAN", False)[:16]
    np.testing.assert_allclose(short.outputs.embedding, want, atol=1e-4)
    with pytest.raises(ValueError, match="one of"):
        llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(dimensions=20), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_tiny_decoder_last_and_cls(tmp_path):
    config = transformers.LlamaConfig(**TINY_DECODER)
    config.architectures = ["LlamaForCausalLM"]
    model = random_model(transformers.LlamaForCausalLM, config, seed=3).eval()
    model.save_pretrained(tmp_path)
    prompts = [rng.integers(0, 96, int(n)).tolist() for n in (3, 50, 33)]
    for pooling in ("LAST", "CLS"):
        llm = LLM(str(tmp_path), runner="pooling", pooler_config={"pooling_type": pooling}, **CHUNKED_ENGINE)
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for p, out in zip(prompts, outputs, strict=True):
            assert_close(out.outputs.embedding, hf_pooled(model, p, pooling, True))


def test_accumulator_chunks_restart_dimensions():
    """The host side alone: MEAN adds chunks and divides by the prompt length, a preempted request's restart from
    position 0 starts the sum again, LAST keeps the final chunk's row, `dimensions` cuts before normalising."""
    from jaxllm.config import PoolerConfig
    from jaxllm.pooling.accumulate import PoolingAccumulator

    mean = PoolingAccumulator(PoolerConfig("MEAN", normalize=False))
    rows = [np.array([1.0, 2.0, 3.0]), np.array([3.0, 4.0, 5.0])]
    mean.add("r", 0, 4, 6, rows[0] * 9)  # a first try, preempted
    mean.add("r", 0, 4, 6, rows[0])
    mean.add("r", 4, 2, 6, rows[1])
    np.testing.assert_allclose(mean.finish("r", 6, PoolingParams()), (rows[0] + rows[1]) / 6)
    last = PoolingAccumulator(PoolerConfig("LAST", normalize=True))
    last.add("r", 0, 4, 6, rows[0])
    last.add("r", 4, 2, 6, rows[1])
    np.testing.assert_allclose(last.finish("r", 6, PoolingParams(dimensions=2)), np.array([3.0, 4.0]) / 5)


def test_pooling_settings_refused_early():
    """Bad pooler settings and what cannot run with the pooling runner fail before anything loads."""
    from jaxllm import EngineArgs
    from jaxllm.config import PoolerConfig

    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        PoolerConfig.parse('{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="unknown field"):
        PoolerConfig.parse({"pooling": "MEAN"})
    with pytest.raises(ValueError, match="runner must be one of generate, pooling"):
        EngineArgs(runner="embed").check()
    for refused in ({"async_scheduling": True}, {"enable_lora": True}):
        with pytest.raises(ValueError, match="--runner pooling"):
            EngineArgs(runner="pooling", **refused).check()
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)

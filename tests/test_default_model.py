"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxllm.model import CausalLM, KVCache
from jaxllm.weights.default import default_model_path
from tests.hf_reference import hf_greedy
from tests.paged_batch import make_step

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
NEW_TOKENS = 32


def chat_ids(tokenizer, prompt):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_tokenizer_matches_transformers(default_model):
    from transformers import AutoTokenizer

    path = default_model_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = default_model.tokenizer
    for text in PROMPTS + ["naïve café — 日本語 🙂", "  spaces\tand\nnewlines "]:
        assert ours.encode(text) == reference.encode(text)
        assert chat_ids(ours, text) == chat_ids(reference, text)
    assert ours.eos_token_id == reference.eos_token_id == 2


def test_default_model_greedy_matches_transformers(default_model, hf_default_model):
    arch, tok = default_model.arch, default_model.tokenizer
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.tie_word_embeddings) == (30, 9, 3, True)
    model = CausalLM(arch, jnp.float32, attention_backend="reference", quant=default_model.quant)
    step_fn = jax.jit(model.apply, donate_argnums=(1,))

    block_size, max_blocks = 16, 8
    shape = (arch.num_layers, 1 + len(PROMPTS) * max_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    cache = KVCache(jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))
    seqs = [chat_ids(tok, p) for p in PROMPTS]
    tables = [list(range(1 + i * max_blocks, 1 + (i + 1) * max_blocks))[::-1] for i in range(len(seqs))]
    prompt_lens = [len(s) for s in seqs]

    # prefill all prompts in one ragged step; compare the last position's logits with transformers
    batch = make_step([(s, 0, len(s), t) for s, t in zip(seqs, tables, strict=True)], block_size, max_blocks)
    logits, cache = step_fn({"params": default_model.params}, cache, batch)
    logits = np.asarray(logits)
    ends = np.cumsum(prompt_lens) - 1
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf_default_model(torch.tensor([s])).logits[0, -1].numpy()
        rel = np.abs(logits[ends[i]] - ref).max() / np.abs(ref).max()
        assert rel < 1e-3, f"prompt {i}: last-position logits differ, rel err {rel:.2e}"
        s.append(int(logits[ends[i]].argmax()))

    # greedy decode: all sequences one token per step through the paged cache
    for _ in range(NEW_TOKENS - 1):
        batch = make_step([(s, len(s) - 1, 1, t) for s, t in zip(seqs, tables, strict=True)], block_size, max_blocks)
        logits, cache = step_fn({"params": default_model.params}, cache, batch)
        for i, s in enumerate(seqs):
            s.append(int(np.asarray(logits)[i].argmax()))

    for i, s in enumerate(seqs):
        expected = hf_greedy(hf_default_model, s[: prompt_lens[i]], NEW_TOKENS)
        got = s[prompt_lens[i] :]
        assert got == expected, f"prompt {i}: {tok.decode(got)!r} != {tok.decode(expected)!r}"

"""Layers that attend differently in one model: full attention beside sliding-window layers (transformers'
`layer_types`), run through a whole engine against transformers on the same weights.

Each run of layers of one kind is its own scanned stack with its own window (`ModelArch.layer_runs`); the KV cache
is still one pool for every layer (blocks out of a window are not freed yet: issue 47's hybrid KV manager).
"""

import numpy as np
import transformers

from jaxllm import LLM, SamplingParams
from jaxllm.model import arch_from_hf_config
from tests.hf_reference import hf_greedy
from tests.tiny_models import CHUNKED_ENGINE, TINY_DECODER, random_model

TINY = dict(TINY_DECODER, num_hidden_layers=3)
rng = np.random.default_rng(11)
PROMPTS = [rng.integers(0, TINY["vocab_size"], int(n)).tolist() for n in rng.integers(20, 60, 6)]  # windows long


def test_full_and_sliding_window_layers_equal_transformers(tmp_path):
    """Qwen2 with `max_window_layers=1`: layer 0 attends to everything, layers 1-2 to the last 8 tokens; prompts
    several windows long, prefilled in 16-token chunks beside decodes, then again from the prefix cache."""
    config = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    config.architectures = ["Qwen2ForCausalLM"]
    model = random_model(transformers.Qwen2ForCausalLM, config).eval()
    model.save_pretrained(tmp_path)
    arch = arch_from_hf_config(config)
    assert [(start, end, kind.sliding_window) for start, end, kind in arch.layer_runs()] == [(0, 1, None), (1, 3, 8)]
    want = [hf_greedy(model, p, 24) for p in PROMPTS]
    llm = LLM(str(tmp_path), **CHUNKED_ENGINE)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second time, the prompts' blocks come from the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
    assert llm.engine.stats()["prefix_cache_hits"] > 0

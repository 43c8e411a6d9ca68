"""jaxllm's decoder against transformers' PyTorch model on the same random weights.

Tiny models of each architecture run a ragged paged batch: whole prompts, a prompt
split over two steps, and decode steps mixed in, reading non-contiguous blocks of a
NaN-poisoned cache. Every computed row's logits must match within 1e-4 (float32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxllm.model import CausalLM, KVCache, arch_from_hf_config
from jaxllm.parallel.mesh import make_mesh
from jaxllm.weights.params import hf_tensor_names, params_from_hf_tensors
from tests.paged_batch import make_step
from tests.tiny_models import MOE_CASES

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

CASES = {
    "llama-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    "llama-tied-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True, num_key_value_heads=4),
    ),
    "mistral-sliding-window": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(  # vocab: no whole panels
            vocab_size=97, sliding_window=6, num_key_value_heads=1, head_dim=32
        ),
    ),
    "qwen2-yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
    "qwen2-mixed-sliding-window": (  # layer 0 full attention, layer 1 a 6-token window: a stack each
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen3-linear-rope": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=16, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}),
    ),
    # Gemma 2: sliding layer 0, global layer 1; soft-caps small enough that tanh bends the scores and logits
    "gemma2-softcaps": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    # Gemma 3: two sliding layers with their own RoPE (base 10), then a global one (linear scaling)
    "gemma3-two-ropes": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
            },
        ),
    ),
}
CASES.update(MOE_CASES)


def random_hf_model(config_cls: str, arch: str, overrides: dict):
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # no zeros anywhere: biases and norm scales random too
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return config, model


# cpu_packed: the engine's CPU path, weights packed. bfloat16: the engine's CPU path for bfloat16 weights
# (activations rounded to bfloat16 at each matmul's input, float32 elsewhere), against transformers in
# float32 on the same bfloat16-rounded weights: within the rounding of the matmul inputs
TOLERANCE = {"auto": 1e-4, "cpu_packed": 1e-4, "cpu_packed-bfloat16": 2e-2}


@pytest.mark.parametrize("mode", list(TOLERANCE))
@pytest.mark.parametrize("case", list(CASES))
def test_ragged_paged_batch_matches_transformers(case, mode):
    config, hf_model = random_hf_model(*CASES[case])
    matmul, _, weights = mode.partition("-")
    if weights:
        with torch.no_grad():
            for p in hf_model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    arch = arch_from_hf_config(config)
    state = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    if arch.moe is None:  # (transformers keeps experts fused in memory: the loader reads both forms)
        assert set(hf_tensor_names(arch)) <= set(state)
    params = params_from_hf_tensors(arch, jnp.dtype(weights or "float32"), state.__getitem__, make_mesh(), case)
    model = CausalLM(arch, jnp.float32, attention_backend="reference", matmul_backend=matmul)
    if matmul == "cpu_packed":  # the layers' kernels, and the LM head (tied or not) unless the vocabulary is 97
        assert model.packs_head() == (arch.vocab_size % 32 == 0)
        params = model.pack(params)
    step_fn = jax.jit(model.apply, donate_argnums=(1,))

    rng = np.random.default_rng(0)
    block_size, num_blocks, max_blocks = 4, 40, 8
    shape = (arch.num_layers, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    cache = KVCache(jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))  # unowned blocks must never be read
    free = list(rng.permutation(np.arange(1, num_blocks)))  # block 0 is scratch
    prompt_lens = [5, 11, 17]
    seqs = [list(rng.integers(0, arch.vocab_size, n)) for n in prompt_lens]
    tables = [[int(free.pop()) for _ in range(max_blocks)] for _ in seqs]
    computed = [0, 0, 0]

    def run(plan):  # padded to one shape (32 rows, 4 sequences): one compilation per model
        nonlocal cache
        real = sum(n for _, n in plan)
        batch = make_step(
            [(seqs[i], computed[i], n, tables[i]) for i, n in plan],
            block_size,
            max_blocks,
            pad_tokens=32 - real,
            pad_seqs=4 - len(plan),
        )
        logits, cache = step_fn({"params": params}, cache, batch)
        logits, row = np.asarray(logits), 0
        for i, n in plan:
            with torch.no_grad():
                ref = hf_model(torch.tensor([seqs[i][: computed[i] + n]])).logits[0, computed[i] :].numpy()
            got = logits[row : row + n]
            assert np.isfinite(got).all()
            rel = np.abs(got - ref).max() / np.abs(ref).max()
            assert rel < TOLERANCE[mode], (
                f"{case}: sequence {i}, rows {computed[i]}..{computed[i] + n}: rel err {rel:.2e}"
            )
            computed[i] += n
            row += n

    run([(0, 5), (1, 6)])  # a whole prompt and the first chunk of another
    seqs[0].append(int(rng.integers(0, arch.vocab_size)))
    run([(1, 5), (0, 1), (2, 17)])  # the rest of that prompt, a decode, a new prompt
    for _ in range(4):  # decode steps through non-contiguous blocks
        for i in range(3):
            seqs[i].append(int(rng.integers(0, arch.vocab_size)))
        run([(0, 1), (1, 1), (2, 1)])


def test_unrolled_layers_match_scanned_layers():
    from jaxllm.weights.params import unstack_layers

    config, hf_model = random_hf_model(*CASES["qwen3-linear-rope"])
    arch = arch_from_hf_config(config)
    state = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    params = params_from_hf_tensors(arch, jnp.float32, state.__getitem__, make_mesh(), "unrolled")
    seq = list(np.random.default_rng(1).integers(0, arch.vocab_size, 13))
    batch = make_step([(seq, 0, 13, [3, 1, 4, 2])], 4, 4, pad_tokens=3, pad_seqs=1)
    shape = (arch.num_layers, 8, 4, arch.num_kv_heads, arch.head_dim)
    results = []
    for scan, p in ((True, params), (False, unstack_layers(params, arch.num_layers))):
        model = CausalLM(arch, jnp.float32, attention_backend="reference", scan_layers=scan)
        cache = KVCache(jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))
        logits, cache = jax.jit(model.apply)({"params": p}, cache, batch)
        results.append((np.asarray(logits[:13]), np.asarray(cache.k[:, [3, 1, 4, 2]])))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        results[0][1].reshape(arch.num_layers, 16, -1)[:, :13],
        results[1][1].reshape(arch.num_layers, 16, -1)[:, :13],
        rtol=1e-5,
        atol=1e-5,
    )

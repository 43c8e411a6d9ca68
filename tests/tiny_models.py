"""Tiny random transformers models, for tests that run jaxllm and PyTorch on the same weights."""

import torch

# a tiny Llama whose every input size (64 hidden, 64 = 4 heads x 16, 128 intermediate) is whole groups of 32 and
# whose every projection is whole panels of 32 columns: the quantized formats and the CPU kernels serve all of it
PANEL_LLAMA = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)

# a tiny decoder (2 layers, 96 tokens) for whole-engine tests against transformers, and the engine that runs it:
# four sequences of 16-token steps, so prompts prefill in chunks beside other sequences' decodes
TINY_DECODER = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CHUNKED_ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=128,
    dtype="float32",
    kv_cache_memory_bytes=1 << 21,
    progress=False,
)

# mixtures of experts: 4-8 experts, top-2 (OLMoE top-3, unnormalised), a shared expert (Qwen2-MoE);
# name → (transformers config class, architecture, config fields)
MOE_CASES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=3)),
    # attention sinks, q/k/v/o biases, 8-token windows every other layer, YaRN; biased router and experts, gate and
    # up interleaved, the clamped SwiGLU
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8),
    ),
}


def random_model(model_class, config, std: float = 0.1, seed: int = 0):
    """`model_class(config)` with N(0, std) weights: its own initialisation is too small for a layout or rounding
    mistake to show in the outputs."""
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(std * torch.randn_like(p))
    return model


# Gemma's chat format, written for the tiny models (Gemma's own tokenizer is gated): turns between <start_of_turn>
# and <end_of_turn>, the assistant called "model", a system message folded into the first user turn as Gemma 3's
# template does
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system' else '' -%}"
    "{%- for m in (messages[1:] if system else messages) -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ ((system if loop.first else '') + m['content']) | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def save_gemma_test_tokenizer(path, vocab_size: int) -> None:
    """A character-level tokenizer with Gemma's special tokens (ids 0-5: <end_of_turn> is 5) and chat template, for
    a tiny model of `vocab_size` tokens: newline and printable ASCII after the specials, the rest unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n", *(chr(c) for c in range(32, 127))][: vocab_size - len(GEMMA_SPECIAL)]
    vocab = {token: i for i, token in enumerate(GEMMA_SPECIAL + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character a token
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=GEMMA_SPECIAL[4:],
    )
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

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


# A tiny Qwen3 whose next token depends only on the last one (attention and MLPs zeroed; the LM head maps each token's
# embedding to its successor), so greedy decoding follows a chain written here: it thinks between <think> and
# </think>, then answers {"answer":4}. Its chat template is Qwen3's in small: `enable_thinking: false` renders an
# empty <think></think> (whose last token, "\n\n", leads straight to the answer).
REASONING_CHAIN = ["\n", "<think>", "Let me think.", " 2+2 is 4.", "</think>", '{"answer":', "4", "}", "<|im_end|>"]
REASONING_TEXT, REASONING_ANSWER = "Let me think. 2+2 is 4.", '{"answer":4}'
QWEN3_THINKING_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
# DeepSeek-R1's way: the template opens the thinking, so the output starts inside it with no tag of its own
R1_TEMPLATE = QWEN3_THINKING_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>'")


def save_reasoning_test_model(path) -> None:
    """The chained Qwen3 above, with a character-level tokenizer whose tags and chain words are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = [w for w in REASONING_CHAIN if len(w) > 1 and w not in special] + ["\n\n"]
    # byte-level characters (GPT-2's: a space is Ġ, a newline Ċ), as Qwen's own tokenizer, which llguidance reads
    chars = [*(chr(c) for c in range(33, 127)), "Ġ", "Ċ"]
    vocab = {token: i for i, token in enumerate(special + words + chars)}
    backend = Tokenizer(models.BPE(vocab, merges=[], unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": special[1:]})
    tokenizer.add_tokens(words)  # matched whole, before the split into characters; not special: they stay in text
    tokenizer.chat_template = QWEN3_THINKING_TEMPLATE
    tokenizer.save_pretrained(path)

    size = 128
    config = Qwen3Config(
        vocab_size=size,
        hidden_size=size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=vocab["<|im_end|>"],
    )
    model = Qwen3ForCausalLM(config)
    ids = {w: vocab["Ċ" if w == "\n" else w] for w in [*REASONING_CHAIN, "\n\n"]}
    successor = {ids[a]: ids[b] for a, b in zip(REASONING_CHAIN, REASONING_CHAIN[1:], strict=False)}
    successor[ids["\n\n"]] = ids['{"answer":']  # thinking off: the answer right away
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.zeros_like(p))
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        for token, after in successor.items():
            model.lm_head.weight[after, token] = 1.0
    model.save_pretrained(path)

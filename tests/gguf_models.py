"""Tiny transformers mixtures of experts and Gemma models written as GGUF files, with llama.cpp's tensor names and
metadata.

Written by the `gguf` package's writer as llama.cpp's converter lays them out: a layer's experts in one tensor per
projection (`ffn_{gate,up,down}_exps`, `[E, out, in]`), Q and K rows of "llama" files (Mixtral) permuted for
llama.cpp's interleaved rotary, the shared expert's gate a vector; Gemma's four norms a layer under their own names,
stored as 1 + w. The experts (a model without experts: its projections) go in `quant_type` (Q8_0, Q4_1, ...),
everything else in F32, so the model a file holds is exactly the transformers model with those weights replaced by
their dequantized values (`write_gguf` returns it).
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import torch

# transformers model_type → llama.cpp's GGUF architecture
GGUF_ARCHITECTURE = {
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{p}.{kind}" for p in "qkv" for kind in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
}
GEMMA_NAMES = {
    **LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows as llama.cpp's converter stores them for "llama" files: each head's halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, kind: gguf.GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(the tensor as the file stores it, its dequantized float32 values)."""
    if kind == gguf.GGMLQuantizationType.F32:
        return w, w
    q = gguf.quants.quantize(w, kind)
    return q, gguf.quants.dequantize(q, kind).reshape(w.shape)


def write_gguf(model, path: Path, quant_type: str, end_of_turn: int | None = None):
    """`model` as a GGUF at `path`, experts (else projections) in `quant_type`, `end_of_turn` as its
    `eot_token_id`; returns the transformers model it holds (a copy of `model` with those weights dequantized)."""
    c = model.config
    arch = GGUF_ARCHITECTURE[c.model_type]
    gemma = arch.startswith("gemma")
    kind = gguf.GGMLQuantizationType[quant_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim if getattr(c, "head_dim", None) else c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # (Gemma 3: one per layer type; the local one is llama.cpp's fixed 10k)
    w.add_rope_freq_base(getattr(c, "rope_theta", None) or rope["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_feed_forward_length(c.intermediate_size)
    if end_of_turn is not None:
        w.add_eot_token_id(end_of_turn)
    num_experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if num_experts:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    if getattr(c, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if gemma:  # (llama.cpp's converter writes no window pattern, local RoPE base or query scale)
        w.add_sliding_window(c.sliding_window)
        if getattr(c, "attn_logit_softcapping", None):
            w.add_float32(f"{arch}.attn_logit_softcapping", c.attn_logit_softcapping)
            w.add_float32(f"{arch}.final_logit_softcapping", c.final_logit_softcapping)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    dequantized = {}
    for name, value in state.items():
        if name == "lm_head.weight":
            w.add_tensor("output.weight", value)
            continue
        if gemma and name.endswith("norm.weight"):
            value = value + 1.0
        if name in GLOBAL_NAMES:
            w.add_tensor(GLOBAL_NAMES[name], value)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            half = value.shape[1] // 2  # (blocks run along H: the parts quantize as the whole does)
            for part, rows in (("gate", value[:, :half]), ("up", value[:, half:])):
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", roundtrip(rows, kind)[0], raw_dtype=_raw(kind))
            dequantized[name] = roundtrip(value, kind)[1]
            continue
        if rest == "mlp.experts.down_proj":
            stored, dequantized[name] = roundtrip(value, kind)
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", stored, raw_dtype=_raw(kind))
            continue
        if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = c.num_attention_heads if rest.startswith("self_attn.q") else c.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        if rest == "mlp.shared_expert_gate.weight":
            value = value.reshape(-1)
        if not num_experts and rest.endswith("_proj.weight"):  # a dense model's projections in `quant_type`
            stored, dequantized[name] = roundtrip(value, kind)
            w.add_tensor(f"blk.{layer}.{(GEMMA_NAMES if gemma else LAYER_NAMES)[rest]}", stored, raw_dtype=_raw(kind))
            continue
        w.add_tensor(f"blk.{layer}.{(GEMMA_NAMES if gemma else LAYER_NAMES)[rest]}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, value in dequantized.items():
            reference.get_parameter(name).copy_(torch.from_numpy(value))
    return reference


def _raw(kind: gguf.GGMLQuantizationType):
    return None if kind == gguf.GGMLQuantizationType.F32 else kind

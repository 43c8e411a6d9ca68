"""Which of a model's matmul weights are kept quantized, and in which format: a `QuantPlan`.

`quantization` is vLLM's argument:
- "auto" (the default; None, vLLM's default, means the same): a GGUF file keeps its Q8_0, Q4_0 and Q4_1 blocks
  as they are; other formats load as float, but a mixture of experts' experts in other quantized types
  (K-quants...), which are re-quantized to int4 or int8 at load (`requantized`).
- "int8": weight-only, symmetric, one scale per output channel, quantized at load from any format.
- "int4": weight-only, groups of 32 along the input with an fp16 scale each (GGUF's Q4_0 layout); the tied
  embedding / LM head in int8, as llama.cpp's 4-bit files keep it in 8 bits (its errors land on the logits).
- "none": every weight dequantized to `dtype` (the float path, kept for comparison).

A plan maps each kind of projection (`LAYER_KINDS`, "embed_tokens", "lm_head") to a format of
`pallas_kernels.stacked_matmul.quantized`; a kind left out stays float. Stacked layers share one array per
kind, so a kind is quantized only when every layer's tensors are in the same kept format. It is decided from
the config and the file's tensor table alone (before any weight is read: the steps compile meanwhile), checked
against the shapes (groups must divide the input, and with tensor parallelism each shard of it), and logged:
nothing stays float without a line saying which tensors and why.
"""

from __future__ import annotations

import logging

from jaxllm.config import check_quantization
from jaxllm.model.quant import QuantPlan
from jaxllm.model.registry import ModelArch
from pallas_kernels.stacked_matmul.quantized import FORMATS

logger = logging.getLogger(__name__)

LAYER_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# a mixture of experts' layers: attention, and the experts' stacked projections (model/moe.py); the router, a
# shared expert and dense layers between the sparse ones stay float
MOE_LAYER_KINDS = (*LAYER_KINDS[:2], "experts_gate_up", "experts_down")
ROW_PARALLEL = ("o_proj", "down_proj", "experts_down")  # their input axis is split over "model"
GGUF_KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGUF type name → format kept as its bits


def input_size(arch: ModelArch, kind: str) -> int:
    """K, the input size a kind's weight contracts (its groups run along it)."""
    if kind == "o_proj":
        return arch.num_heads * arch.head_dim
    if kind == "down_proj":
        return arch.intermediate_size
    if kind == "experts_down":
        assert arch.moe is not None
        return arch.moe.intermediate_size
    return arch.hidden_size


def gguf_tensor_names(arch: ModelArch, kind: str) -> list[str]:
    """The GGUF tensors behind one kind (every layer's, every fused part's; experts: the sparse layers')."""
    parts = {
        "qkv_proj": ("attn_q", "attn_k", "attn_v"),
        "o_proj": ("attn_output",),
        "gate_up_proj": ("ffn_gate", "ffn_up"),
        "down_proj": ("ffn_down",),
        "experts_gate_up": ("ffn_gate_exps", "ffn_up_exps"),
        "experts_down": ("ffn_down_exps",),
    }
    if kind == "embed_tokens":
        return ["token_embd.weight"]
    if kind == "lm_head":
        return ["output.weight"]
    layers = [i for i in range(arch.num_layers) if arch.layer_kind(i).experts or not kind.startswith("experts_")]
    return [f"blk.{i}.{p}.weight" for i in layers for p in parts[kind]]


FLOAT_TYPES = ("F32", "F16", "BF16")


def requantized(types: list[str]) -> str:
    """The kept format a GGUF's experts in other quantized types (K-quants, IQ, MXFP4...) are re-quantized to at
    load: int8 where any is 5 bits or more, else int4 (experts are never expanded to float: they are most of
    the model)."""
    return "int8" if any(t.startswith(("Q5", "Q6", "Q8")) for t in types) else "int4"


def make_plan(arch: ModelArch, quantization: str | None, gguf_types: dict[str, str] | None, tp: int = 1) -> QuantPlan:
    """The plan for `arch` under `quantization`; `gguf_types`: a GGUF file's tensor name → GGML type name
    (None for other formats); `tp`: the tensor-parallel size. ValueError naming the tensor and the rule when the
    model cannot take the quantization asked for; a GGUF's own blocks that cannot be kept (a tensor-parallel split
    through a group) are dequantized instead, with a log line."""
    quantization = check_quantization(quantization)
    layer_kinds = LAYER_KINDS if arch.moe is None else MOE_LAYER_KINDS
    kinds = [*layer_kinds, "embed_tokens"] + ([] if arch.tie_word_embeddings else ["lm_head"])
    wanted: dict[str, str] = {}
    if quantization in ("int8", "int4"):
        for kind in kinds:
            wanted[kind] = quantization if kind in layer_kinds else "int8"
    elif quantization == "auto" and gguf_types is not None:
        for kind in kinds:
            names = gguf_tensor_names(arch, kind)
            types = sorted({gguf_types.get(name, "missing") for name in names})
            if len(types) == 1 and types[0] in GGUF_KEPT:
                wanted[kind] = GGUF_KEPT[types[0]]
            elif kind.startswith("experts_") and not set(types) & {*FLOAT_TYPES, "missing"}:
                wanted[kind] = requantized(types)
                logger.info(
                    "GGUF %s (%s...) are %s: re-quantized to %s at load", kind, names[0], "/".join(types), wanted[kind]
                )
            elif not (len(types) == 1 and types[0] in FLOAT_TYPES):
                why = f"mixed types {'/'.join(types)}" if len(types) > 1 else f"{types[0]} is not a kept format"
                logger.info("GGUF %s (%s...) dequantized to float: %s", kind, names[0], why)
    for kind, fmt in list(wanted.items()):
        try:
            _check(arch, kind, fmt, tp, quantization)
        except ValueError as e:
            if quantization != "auto":  # asked for: refused
                raise
            logger.info("GGUF %s dequantized to float: %s", kind, e)  # the default: what can stay quantized does
            del wanted[kind]
    return QuantPlan(tuple(sorted(wanted.items())))


def _check(arch: ModelArch, kind: str, fmt: str, tp: int, quantization: str | None) -> None:
    group = FORMATS[fmt].group
    k = input_size(arch, kind)
    asked = f"quantization={quantization!r}" if quantization != "auto" else f"the GGUF's {fmt.upper()} blocks"
    if group is not None and k % group:
        raise ValueError(
            f"{asked}: {kind} has {k} inputs, not a multiple of the group size {group} ({fmt} groups run along the "
            f"input); use quantization='int8' (per channel) or 'none'"
        )
    whole_experts = kind.startswith("experts_") and arch.moe is not None and arch.moe.expert_parallel
    if group is not None and kind in ROW_PARALLEL and not whole_experts and tp > 1 and (k // tp) % group:
        raise ValueError(
            f"{asked}: tensor_parallel_size={tp} splits {kind}'s {k} inputs into shards of {k // tp}, which splits "
            f"a group of {group}: use a tensor-parallel size that keeps whole groups, or quantization='int8'"
        )

"""The CPU kernels a model's step runs: `pallas_kernels.cpu_choice`'s self-check on this model's shapes."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxllm.config import EngineConfig
from jaxllm.model.quant import NO_QUANT, QuantPlan, packs_quantized
from jaxllm.model.registry import ModelArch
from pallas_kernels import cpu_choice, stacked_matmul

logger = logging.getLogger(__name__)


def layer_matmul_shapes(arch: ModelArch, dtype, quant: QuantPlan = NO_QUANT) -> tuple[tuple, ...]:
    """A decoder layer's projections that "cpu_packed" packs (qkv, o, gate_up, down): (K, N) in `dtype`, or
    (K, N, format) for those `quant` keeps quantized."""
    a = arch
    group = a.num_heads // a.num_kv_heads
    shapes = {
        "qkv_proj": (a.hidden_size, a.num_kv_heads * (group + 2) * a.head_dim),
        "o_proj": (a.num_heads * a.head_dim, a.hidden_size),
        "gate_up_proj": (a.hidden_size, 2 * a.intermediate_size),
        "down_proj": (a.intermediate_size, a.hidden_size),
    }
    out: list[tuple] = []
    for name, (k, n) in shapes.items():
        if fmt := quant.get(name):
            out += [(k, n, fmt)] if packs_quantized((1, k, n)) else []
        elif stacked_matmul.packable(jax.ShapeDtypeStruct((1, k, n), dtype)):
            out.append((k, n))
    return tuple(out)


def kernel_choice(
    arch: ModelArch, config: EngineConfig, dtype, quant: QuantPlan = NO_QUANT, *, matmul: bool
) -> cpu_choice.KernelChoice:
    """The choice for this model (`matmul`: its projections could run the packed kernel), logged once."""
    kv_dtype = jnp.dtype(config.cache.kv_dtype(jnp.dtype(dtype))).name
    attention = cpu_choice.AttentionShape(
        arch.num_heads, arch.num_kv_heads, arch.head_dim, config.cache.block_size, kv_dtype
    )
    shapes = layer_matmul_shapes(arch, dtype, quant) if matmul else ()
    max_rows = config.scheduler.max_num_batched_tokens
    choice = cpu_choice.choose(shapes, jnp.dtype(dtype).name, max_rows, attention)
    if choice not in _logged:
        _logged.add(choice)
        logger.info(choice.describe())
    return choice


_logged: set[cpu_choice.KernelChoice] = set()

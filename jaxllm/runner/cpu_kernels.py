"""The CPU kernels a model's step runs: `pallas_kernels.cpu_choice`'s self-check on this model's shapes."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxllm.config import EngineConfig
from jaxllm.model.registry import ModelArch
from pallas_kernels import cpu_choice, stacked_matmul

logger = logging.getLogger(__name__)


def layer_matmul_shapes(arch: ModelArch, dtype) -> tuple[tuple[int, int], ...]:
    """(K, N) of a decoder layer's projections that "cpu_packed" packs: qkv, o, gate_up, down."""
    a = arch
    group = a.num_heads // a.num_kv_heads
    shapes = [
        (a.hidden_size, a.num_kv_heads * (group + 2) * a.head_dim),
        (a.num_heads * a.head_dim, a.hidden_size),
        (a.hidden_size, 2 * a.intermediate_size),
        (a.intermediate_size, a.hidden_size),
    ]
    return tuple((k, n) for k, n in shapes if stacked_matmul.packable(jax.ShapeDtypeStruct((1, k, n), dtype)))


def kernel_choice(arch: ModelArch, config: EngineConfig, dtype, *, matmul: bool) -> cpu_choice.KernelChoice:
    """The choice for this model (`matmul`: its projections could run the packed kernel), logged once."""
    kv_dtype = jnp.dtype(config.cache.kv_dtype(jnp.dtype(dtype))).name
    attention = cpu_choice.AttentionShape(
        arch.num_heads, arch.num_kv_heads, arch.head_dim, config.cache.block_size, kv_dtype
    )
    shapes = layer_matmul_shapes(arch, dtype) if matmul else ()
    max_rows = config.scheduler.max_num_batched_tokens
    choice = cpu_choice.choose(shapes, jnp.dtype(dtype).name, max_rows, attention)
    if choice not in _logged:
        _logged.add(choice)
        logger.info(choice.describe())
    return choice


_logged: set[cpu_choice.KernelChoice] = set()

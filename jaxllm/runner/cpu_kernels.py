"""The CPU kernels a model's step runs (`pallas_kernels.cpu_choice`'s self-check on this model's shapes), and the
model the step runs with them: its attention and matmul backends, and how the loader lays the weights out."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.config import EngineConfig
from jaxllm.kv_cache_groups import KVCacheGroups
from jaxllm.model import CausalLM
from jaxllm.model.quant import NO_QUANT, QuantPlan, packs_quantized
from jaxllm.model.registry import ModelArch
from jaxllm.weights import Layout
from pallas_kernels import cpu_choice, stacked_matmul
from pallas_kernels.cpu_choice import KernelChoice

logger = logging.getLogger(__name__)


def layer_matmul_shapes(arch: ModelArch, dtype, quant: QuantPlan = NO_QUANT) -> tuple[tuple, ...]:
    """A decoder layer's projections that "cpu_packed" packs (qkv, o, gate_up, down; a mixture of experts' router
    and shared expert, not its experts): (K, N) in `dtype`, or
    (K, N, format) for those `quant` keeps quantized."""
    a = arch
    group = a.num_heads // a.num_kv_heads
    mlps = {a.intermediate_size} if a.moe is None or a.moe.dense_layers else set()  # experts: not packed
    if a.moe is not None and a.moe.shared_expert_intermediate_size:
        mlps.add(a.moe.shared_expert_intermediate_size)
    shapes = [
        ("qkv_proj", (a.hidden_size, a.num_kv_heads * (group + 2) * a.head_dim)),
        ("o_proj", (a.num_heads * a.head_dim, a.hidden_size)),
        *[("gate_up_proj", (a.hidden_size, 2 * size)) for size in sorted(mlps)],
        *[("down_proj", (size, a.hidden_size)) for size in sorted(mlps)],
        *([("router", (a.hidden_size, a.moe.num_experts))] if a.moe is not None else []),
    ]
    out: list[tuple] = []
    for name, (k, n) in shapes:
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


def cpu_kernel_choice(arch, config: EngineConfig, dtype, mesh: Mesh, quant: QuantPlan) -> KernelChoice | None:
    """Which C++ kernels a step on this platform runs, where they beat XLA (the machine's self-check,
    `JAXLLM_CPU_KERNELS`); None off the CPU, and on a CPU mesh (the kernels have no partitioning rules)."""
    if jax.default_backend() != "cpu" or mesh.size > 1:
        return None
    packable = config.model.scan_layers and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)
    return kernel_choice(arch, config, dtype, quant, matmul=packable)


def step_model(
    arch, config: EngineConfig, dtype, mesh: Mesh, quant: QuantPlan = NO_QUANT, kv_groups: KVCacheGroups | None = None
) -> CausalLM:
    """The model the step runs: attention and matmul backends, and the dtype it computes in, for this platform;
    `kv_groups`: where each layer's K/V lives (None: a slot per layer, one block table)."""
    scan, attention = config.model.scan_layers, config.model.attention_backend
    matmul, compute_dtype, kernel_max_rows, int8_min_rows = "auto", dtype, None, 0
    choice = cpu_kernel_choice(arch, config, dtype, mesh, quant)
    if mesh.size > 1 and jax.default_backend() == "cpu":  # the C++ kernels have no partitioning rules:
        attention = "reference" if attention == "auto" else attention  # XLA would all-gather the cache
        matmul = "reference"  # and the weights
    elif choice is not None:
        if attention == "auto":  # an explicit attention_backend wins over the choice
            attention = "cpu" if choice.attention else "reference"
        if choice.matmul:
            # the loader (`weight_layout`) or set_params packs the matmul weights for it. bfloat16 weights: the
            # kernel rounds x to bfloat16 for its dot product, and the rest of the step (norms, rotary, residual,
            # SwiGLU) runs in float32, which XLA's CPU backend runs 3-4x faster than bfloat16 (benchmarks/NOTES.md
            # lever 13) and which is the more accurate
            matmul, compute_dtype, kernel_max_rows = "cpu_packed", jnp.float32, choice.matmul_max_rows
            int8_min_rows = choice.int8_min_rows
        else:
            matmul = "reference"  # XLA's dot ("auto" would take the unpacked kernel)
    return CausalLM(
        arch,
        compute_dtype,
        attention,
        scan_layers=scan,
        matmul_backend=matmul,
        matmul_kernel_max_rows=kernel_max_rows,
        matmul_int8_min_rows=int8_min_rows,
        quant=quant,
        expert_mesh=mesh if arch.moe is not None and arch.moe.expert_parallel else None,
        # one GPU: the experts' grouped matmul by the Pallas kernel (it has no partitioning rule either)
        expert_kernel="pallas" if jax.default_backend() == "gpu" and mesh.size == 1 else None,
        kv_groups=kv_groups,
    )


def weight_layout(arch, config: EngineConfig, dtype, mesh: Mesh, quant: QuantPlan = NO_QUANT) -> Layout | None:
    """How the step wants the loaded weights rearranged (the loader may keep the result on disk), or None."""
    model = step_model(arch, config, dtype, mesh, quant)
    return Layout(model.matmul_backend, model.pack_leaf) if model.matmul_backend == "cpu_packed" else None

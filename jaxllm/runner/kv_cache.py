"""The paged KV cache on device: sized from a memory budget, sharded over KV heads.

Layout (docs/design.md): K and V each `[slots, num_blocks, block_size, num_kv_heads, head_dim]`, a slot per layer
of a KV cache group (kv_cache_groups.py): one per layer unless the hybrid manager groups the layers.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.config import CacheConfig, EngineConfig
from jaxllm.distributed.runtime import agree_min
from jaxllm.kv_cache_groups import KVCacheGroups
from jaxllm.model import KVCache, ModelArch
from jaxllm.parallel.mesh import kv_cache_sharding

logger = logging.getLogger(__name__)

CPU_SHARE_OF_RAM = 0.15  # of the machine's RAM: a fixed share, so the cache (a compiled shape) is the same every run
CPU_CAP_BYTES = 2 << 30
CPU_SHARE_OF_FREE_RAM = 0.5  # but never more than this share of what is free now
ACCELERATOR_HEADROOM_BYTES = 1 << 30  # activations, compiled code, allocator slack


def kv_cache_groups(arch: ModelArch, config: EngineConfig) -> KVCacheGroups:
    """The KV cache groups the engine runs `arch` with: by attention kind (the hybrid manager), unless
    `disable_hybrid_kv_cache_manager` turns it off."""
    hybrid = not config.cache.disable_hybrid_kv_cache_manager
    return KVCacheGroups.plan(arch.layer_windows(), config.scheduler.max_model_len, hybrid)


def bytes_per_block(arch: ModelArch, block_size: int, dtype, num_shards: int = 1, slots: int | None = None) -> int:
    """K and V of one block in all its slots (None: every layer), on one device of a mesh sharding KV heads
    `num_shards` ways."""
    heads = -(-arch.num_kv_heads // num_shards)
    layers = arch.num_layers if slots is None else slots
    return 2 * layers * block_size * heads * arch.head_dim * jnp.dtype(dtype).itemsize


def _ram() -> tuple[int, int]:
    """(total, available) bytes of RAM."""
    total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, available


def kv_cache_budget(config: CacheConfig) -> int:
    """Bytes per device for the cache: explicit, else a share of free device memory (CPU: of RAM, capped)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        total, available = _ram()
        return int(min(CPU_SHARE_OF_RAM * total, CPU_CAP_BYTES, CPU_SHARE_OF_FREE_RAM * available))
    limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
    return max(int(config.gpu_memory_utilization * limit) - in_use - ACCELERATOR_HEADROOM_BYTES, 0)


def _stable(num_blocks: int, significant_bits: int = 4) -> int:
    """Round down to `significant_bits` binary digits (losing under 1/8 of the blocks): free memory drifts
    from run to run, and every distinct block count is a distinct compiled shape, missing the compile caches."""
    drop = max(num_blocks.bit_length() - significant_bits, 0)
    return num_blocks >> drop << drop


def num_kv_blocks(arch: ModelArch, config: CacheConfig, dtype, mesh: Mesh, slots: int | None = None) -> int:
    per_block = bytes_per_block(arch, config.block_size, dtype, mesh.shape["model"], slots)
    blocks = kv_cache_budget(config) // per_block
    if config.kv_cache_memory_bytes is None:  # a budget taken from free memory: keep the shape stable
        blocks = _stable(blocks)
    return agree_min(blocks)  # multi-host: one compiled cache shape everywhere


def allocate_kv_cache(
    arch: ModelArch, num_blocks: int, block_size: int, dtype, mesh: Mesh, slots: int | None = None
) -> KVCache:
    shape = (arch.num_layers if slots is None else slots, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=kv_cache_sharding(mesh))
    return KVCache(zeros(), zeros())

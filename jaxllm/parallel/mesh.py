"""The device mesh: axes ("data", "model"), one device by default (docs/design.md, Sharding)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1) -> Mesh:
    devices = jax.devices()
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} needs "
            f"{needed} devices, but only {len(devices)} {jax.default_backend()} device(s) are visible"
        )
    grid = np.array(devices[:needed]).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """K/V `[L, num_blocks, block_size, Hkv, D]`: KV heads over "model"."""
    return NamedSharding(mesh, PartitionSpec(None, None, None, "model", None))

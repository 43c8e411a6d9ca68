"""`load_format="dummy"`: random weights for any architecture, made on the devices, no file read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.model.layers import INIT_STD
from jaxllm.model.registry import ModelArch
from jaxllm.weights.params import abstract_params, param_shardings


def dummy_params(arch: ModelArch, dtype, mesh: Mesh, seed: int = 0):
    shapes, specs = abstract_params(arch, dtype)
    paths_and_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    def make():
        keys = jax.random.split(jax.random.key(seed), len(paths_and_shapes))
        leaves = []
        for key, (path, shape) in zip(keys, paths_and_shapes, strict=True):
            noise = INIT_STD * jax.random.normal(key, shape.shape, jnp.float32)
            is_norm = path[-1].key == "weight"  # RMSNorm scales sit near one
            leaves.append((1.0 + noise if is_norm else noise).astype(shape.dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return jax.jit(make, out_shardings=param_shardings(specs, mesh))()

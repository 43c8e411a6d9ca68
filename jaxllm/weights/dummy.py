"""`load_format="dummy"`: random weights for any architecture, made on the devices, no file read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.model.layers import INIT_STD
from jaxllm.model.quant import NO_QUANT, QuantPlan
from jaxllm.model.registry import ModelArch
from jaxllm.weights.params import abstract_params, param_shardings


def dummy_params(arch: ModelArch, dtype, mesh: Mesh, seed: int = 0, quant: QuantPlan = NO_QUANT):
    """Float leaves ~ N(0, INIT_STD) (norm scales near one); quantized arrays: random quants with scales that give
    weights of about INIT_STD (model/quant.py), never zeros."""
    shapes, specs = abstract_params(arch, dtype, quant)
    paths_and_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    def leaf(key, name: str, shape) -> jax.Array:
        if name == "qweight":
            info = jnp.iinfo(shape.dtype)
            return jax.random.randint(key, shape.shape, info.min, int(info.max) + 1, jnp.int32).astype(shape.dtype)
        if name in ("scales", "mins"):  # a quant's spread is ~73 (int8) or ~4.6 (4-bit pairs)
            sign = -1.0 if name == "mins" else 1.0
            return (sign * INIT_STD / 16 * (1 + jax.random.uniform(key, shape.shape))).astype(shape.dtype)
        noise = INIT_STD * jax.random.normal(key, shape.shape, jnp.float32)
        return (1.0 + noise if name == "weight" else noise).astype(shape.dtype)  # RMSNorm scales sit near one

    def make():
        keys = jax.random.split(jax.random.key(seed), len(paths_and_shapes))
        leaves = [leaf(key, path[-1].key, shape) for key, (path, shape) in zip(keys, paths_and_shapes, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return jax.jit(make, out_shardings=param_shardings(specs, mesh))()

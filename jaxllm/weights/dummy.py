"""`load_format="dummy"`: random weights for any architecture, made on the devices, no file read."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxllm.model.layers import INIT_STD
from jaxllm.model.quant import NO_QUANT, QuantPlan
from jaxllm.model.registry import ModelArch
from jaxllm.weights.params import Layout, abstract_params, leaf_path, param_shardings


def dummy_params(
    arch: ModelArch, dtype, mesh: Mesh, seed: int = 0, quant: QuantPlan = NO_QUANT, layout: Layout | None = None
):
    """Float leaves ~ N(0, INIT_STD) (norm scales near one); quantized arrays: random quants with scales that give
    weights of about INIT_STD (model/quant.py), never zeros; laid out by `layout` leaf by leaf, so a leaf and its
    rearranged copy are the only two alive at once.

    Each leaf is made by its own compiled call, layer by layer (`_leaf`): one call for the whole tree asked for
    45 GB of temporaries for OLMoE-1B-7B's shape in int4 (4.4 GB of weights) and failed."""
    shapes, specs = abstract_params(arch, dtype, quant)
    paths_and_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    shardings = jax.tree.leaves(param_shardings(specs, mesh))
    keys = jax.random.split(jax.random.key(seed), len(paths_and_shapes))
    leaves = []
    for key, (path, shape), sharding in zip(keys, paths_and_shapes, shardings, strict=True):
        make = partial(_leaf, name=path[-1].key, shape=shape.shape, dtype=jnp.dtype(shape.dtype))
        value = jax.jit(make, out_shardings=sharding)(key)
        leaves.append(value if layout is None else layout.leaf(leaf_path(path), value))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _leaf(key, *, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
    """One leaf; a stack of layers (`[L, ...]`, 3 axes or more) one layer at a time: a draw's temporaries are ~16
    bytes an element, 32 GB for one stack of OLMoE-1B-7B's int4 experts drawn whole."""
    if len(shape) >= 3:
        return jax.lax.map(lambda k: _draw(k, name, shape[1:], dtype), jax.random.split(key, shape[0]))
    return _draw(key, name, shape, dtype)


def _draw(key, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
    if name == "qweight":  # uniform bytes: every int8 value, or every pair of 4-bit quants
        return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8), dtype)
    if name in ("scales", "mins"):  # a quant's spread is ~73 (int8) or ~4.6 (4-bit pairs)
        sign = -1.0 if name == "mins" else 1.0
        return (sign * INIT_STD / 16 * (1 + jax.random.uniform(key, shape))).astype(dtype)
    noise = INIT_STD * jax.random.normal(key, shape, jnp.float32)
    return (1.0 + noise if name == "weight" else noise).astype(dtype)  # RMSNorm scales sit near one

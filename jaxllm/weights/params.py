"""The parameter tree of a `ModelArch`, and how it is filled from HF-named tensors.

Every loader (safetensors, GGUF, dummy) ends here: it supplies tensors by their
transformers name (`model.layers.3.self_attn.q_proj.weight`, `[out, in]`), and
`params_from_hf_tensors` stacks the layers, transposes kernels to `[in, out]`, casts,
and places each leaf on the mesh with its PartitionSpec.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.model.llama import CausalLM, KVCache, StepInputs
from jaxllm.model.registry import ModelArch

Params = Any
GetTensor = Callable[[str], np.ndarray]


def _tiny_inputs(arch: ModelArch, dtype) -> tuple[KVCache, StepInputs]:
    i32 = jnp.int32
    cache = jnp.zeros((arch.num_layers, 2, 1, arch.num_kv_heads, arch.head_dim), dtype)
    batch = StepInputs(
        token_ids=jnp.zeros((1,), i32), positions=jnp.zeros((1,), i32), slot_mapping=jnp.zeros((1,), i32),
        cu_q_lens=jnp.array([0, 1], i32), kv_lens=jnp.ones((1,), i32), block_tables=jnp.zeros((1, 1), i32),
        num_seqs=jnp.ones((1,), i32), logits_indices=jnp.zeros((1,), i32),
    )
    return KVCache(cache, cache), batch


def abstract_params(arch: ModelArch, dtype) -> tuple[Params, Params]:
    """(tree of ShapeDtypeStruct, tree of PartitionSpec) — computed without allocating anything."""
    model = CausalLM(arch, dtype, attention_backend="reference")
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *_tiny_inputs(arch, dtype))["params"])
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def param_shardings(specs: Params, mesh: Mesh) -> Params:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def hf_tensor_name(path: tuple[str, ...], layer: int | None) -> str:
    """The transformers name of the tensor behind one leaf of the parameter tree."""
    *modules, leaf = path
    kind = "bias" if leaf == "bias" else "weight"
    if modules == ["embed_tokens"]:
        return "model.embed_tokens.weight"
    if modules == ["lm_head"]:
        return "lm_head.weight"
    if modules[0] == "layers":
        return f"model.layers.{layer}.{'.'.join(modules[1:])}.{kind}"
    return f"model.{'.'.join(modules)}.{kind}"


def _leaf_path(key_path) -> tuple[str, ...]:
    return tuple(k.key for k in key_path)


def params_from_hf_tensors(arch: ModelArch, dtype, get_tensor: GetTensor, mesh: Mesh, source: str) -> Params:
    """Build the device parameter tree, reading each tensor by its transformers name."""
    shapes, specs = abstract_params(arch, dtype)
    shardings = param_shardings(specs, mesh)
    np_dtype = np.dtype(jnp.dtype(dtype))

    def load(key_path, shape, sharding):
        path = _leaf_path(key_path)
        layers = range(arch.num_layers) if path[0] == "layers" else [None]
        tensors = []
        for layer in layers:
            name = hf_tensor_name(path, layer)
            tensor = np.asarray(get_tensor(name))
            if path[-1] == "kernel":
                tensor = tensor.T
            tensors.append(tensor.astype(np_dtype, copy=False))
        value = np.stack(tensors) if path[0] == "layers" else tensors[0]
        if value.shape != shape.shape:
            raise ValueError(
                f"{source}: tensor {hf_tensor_name(path, 0)} has shape {value.shape}, expected {shape.shape} "
                f"for {arch.architecture}"
            )
        return jax.device_put(value, sharding)

    return jax.tree_util.tree_map_with_path(load, shapes, shardings)


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """Every transformers tensor name the model reads (for completeness checks)."""
    shapes, _ = abstract_params(arch, jnp.float32)
    names = []
    for key_path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        path = _leaf_path(key_path)
        layers = range(arch.num_layers) if path[0] == "layers" else [None]
        names.extend(hf_tensor_name(path, layer) for layer in layers)
    return names


def unstack_layers(params: Params, num_layers: int) -> Params:
    """Stacked "layers" `[L, ...]` → "layers_0".."layers_{L-1}", for the unrolled model.

    Each slice keeps its leaf's sharding minus the layer axis. Checkpoints and loaders always
    use the stacked form; this runs once, when an engine starts.
    """
    def layer(i):
        def take(x):
            return jax.device_put(x[i], NamedSharding(x.sharding.mesh, PartitionSpec(*x.sharding.spec[1:])))
        return jax.tree.map(take, params["layers"])

    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**rest, **{f"layers_{i}": layer(i) for i in range(num_layers)}}

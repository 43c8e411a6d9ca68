"""The parameter tree of a `ModelArch`, and how it is filled from HF-named tensors.

Every loader (safetensors, GGUF) ends here: it supplies tensors by their transformers
name (`model.layers.3.self_attn.q_proj.weight`, `[out, in]`), and `params_from_hf_tensors`
transposes kernels to `[in, out]` once, at load time, fuses the projections the model
runs as one matmul (q/k/v → `qkv_proj`, gate/up → `gate_up_proj`), stacks the layers,
casts, lays each layer out as the step reads it (`Layout`), and places each leaf on the
mesh with its PartitionSpec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.model.llama import CausalLM, KVCache, StepInputs, stack_start
from jaxllm.model.quant import NO_QUANT, QUANT_LEAVES, QuantPlan
from jaxllm.model.registry import ModelArch
from jaxllm.weights.quant.gguf_blocks import QuantizedTensor
from jaxllm.weights.quant.plan import GGUF_KEPT
from jaxllm.weights.quant.quantize import Parts, from_blocks, quantize_kernel
from pallas_kernels.stacked_matmul.quantized import FORMATS

Params = Any
GetTensor = Callable[[str], np.ndarray]
GetBlocks = Callable[[str], QuantizedTensor]  # a GGUF tensor kept in its bits, by transformers name


def _tiny_inputs(arch: ModelArch, dtype) -> tuple[KVCache, StepInputs[jax.Array]]:
    i32 = jnp.int32
    cache = jnp.zeros((arch.num_layers, 2, 1, arch.num_kv_heads, arch.head_dim), dtype)
    batch = StepInputs(
        token_ids=jnp.zeros((1,), i32),
        positions=jnp.zeros((1,), i32),
        slot_mapping=jnp.zeros((1, 1), i32),
        cu_q_lens=jnp.array([0, 1], i32),
        kv_lens=jnp.ones((1,), i32),
        block_tables=jnp.zeros((1, 1, 1), i32),
        num_seqs=jnp.ones((1,), i32),
        logits_indices=jnp.zeros((1,), i32),
    )
    return KVCache(cache, cache), batch


@lru_cache(maxsize=8)  # an engine start asks twice (compiling, loading): tracing `init` costs ~0.3 s
def abstract_params(arch: ModelArch, dtype, quant: QuantPlan = NO_QUANT) -> tuple[Params, Params]:
    """(tree of ShapeDtypeStruct, tree of PartitionSpec) — computed without allocating anything; `quant`: the
    projections kept quantized (their arrays in place of a float kernel). Shared: do not mutate."""
    model = CausalLM(arch, dtype, attention_backend="reference", matmul_backend="reference", quant=quant)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *_tiny_inputs(arch, dtype))["params"])
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def param_shardings(specs: Params, mesh: Mesh) -> Params:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


# fused leaves → the transformers modules they are made of, in order along the parts axis (-2)
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# a mixture of experts' stacked weights (modules) → each expert's transformers modules (Mixtral's names, the others')
EXPERT_MODULES = {
    "experts_gate_up": (("w1", "w3"), ("gate_proj", "up_proj")),
    "experts_down": (("w2",), ("down_proj",)),
}
# the same weights as transformers 5 keeps them in memory (and saves them with save_original_format=False)
FUSED_EXPERTS = {"experts_gate_up": "gate_up_proj", "experts_down": "down_proj"}


def _hf_module(module: str, arch: ModelArch | None) -> str:
    """A module's transformers name where it differs from jaxllm's (the router, Mixtral's sparse block)."""
    if module == "router":
        return "router" if arch is not None and arch.architecture == "GptOssForCausalLM" else "gate"
    if module == "mlp" and arch is not None and arch.architecture == "MixtralForCausalLM":
        return "block_sparse_moe"
    return module


def hf_tensor_names_of(path: tuple[str, ...], layer: int | None, arch: ModelArch | None = None) -> list[str]:
    """The transformers names of the tensors behind one leaf of the parameter tree (experts: each expert's, as
    checkpoints are saved; `fused_expert_name` gives the fused form)."""
    *modules, leaf = path
    kind = "bias" if leaf == "bias" else "weight"
    if modules == ["embed_tokens"]:
        return ["model.embed_tokens.weight"]
    if modules == ["lm_head"]:
        return ["lm_head.weight"]
    if stack_start(modules[0]) is None:
        return [f"model.{'.'.join(modules)}.{kind}"]
    if leaf == "sinks":  # gpt-oss: a tensor of its own in self_attn
        return [f"model.layers.{layer}.self_attn.sinks"]
    parents = [_hf_module(m, arch) for m in modules[1:]]
    if modules[-1] in EXPERT_MODULES:
        assert arch is not None and arch.moe is not None, path
        mixtral, other = EXPERT_MODULES[modules[-1]]
        parts = mixtral if arch.architecture == "MixtralForCausalLM" else other
        prefix = ".".join([f"model.layers.{layer}", *parents[:-1], "experts"])
        return [f"{prefix}.{e}.{part}.weight" for e in range(arch.moe.num_experts) for part in parts]
    *parents, module = parents
    prefix = ".".join([f"model.layers.{layer}", *parents])
    return [f"{prefix}.{part}.{kind}" for part in FUSED_MODULES.get(module, (module,))]


def fused_expert_name(path: tuple[str, ...], layer: int, arch: ModelArch) -> str:
    """transformers 5's fused tensor behind an expert leaf: gate_up_proj `[E, 2I, H]`, down_proj `[E, H, I]` (gpt-oss:
    `[E, H, 2I]` with gate and up interleaved, `[E, I, H]`, and their biases `gate_up_proj_bias`, `down_proj_bias`)."""
    parents = [_hf_module(m, arch) for m in path[1:-2]]
    name = FUSED_EXPERTS[path[-2]] + ("_bias" if path[-1] == "bias" else "")
    return ".".join([f"model.layers.{layer}", *parents, "experts", name])


def _mixtral_aliases(get_tensor: GetTensor) -> GetTensor:
    """Mixtral's sparse block is `block_sparse_moe` on disk and `mlp` in transformers 5's fused form: try both."""

    def get(name: str) -> np.ndarray:
        try:
            return get_tensor(name)
        except KeyError:
            if ".block_sparse_moe." not in name:
                raise
            return get_tensor(name.replace(".block_sparse_moe.", ".mlp."))

    return get


def _expert_leaf(path: tuple[str, ...], layer: int, arch: ModelArch, get_tensor: GetTensor) -> np.ndarray:
    """A layer's stacked experts, `[E, H, 2, I]` (gate_up) or `[E, I, H]` (down), from either saved form; or their
    biases, `[E, 2, I]` and `[E, H]` (gpt-oss)."""
    if arch.architecture == "GptOssForCausalLM":
        return _from_gpt_oss(path, np.asarray(get_tensor(fused_expert_name(path, layer, arch))))
    try:
        fused = np.asarray(get_tensor(fused_expert_name(path, layer, arch)))
    except KeyError:  # each expert's own tensors, [out, in]
        parts = [np.asarray(get_tensor(name)).T for name in hf_tensor_names_of(path, layer, arch)]
        if path[-2] == "experts_down":
            return np.stack(parts)
        return np.stack([np.stack(parts[i : i + 2], axis=-2) for i in range(0, len(parts), 2)])
    return _from_fused(path, fused)


def _from_fused(path: tuple[str, ...], fused: np.ndarray) -> np.ndarray:
    """transformers 5's fused experts `[E, out, in]` (or their quants' rows) → the leaf's `[E, in, *out]`."""
    if path[-2] == "experts_down":
        return fused.transpose(0, 2, 1)
    e, two_i, h = fused.shape
    return fused.transpose(0, 2, 1).reshape(e, h, 2, two_i // 2)


def _from_gpt_oss(path: tuple[str, ...], fused: np.ndarray) -> np.ndarray:
    """gpt-oss's experts as saved (`[E, in, out]`, gate and up interleaved along gate_up's out) → the leaf's."""
    if path[-2] == "experts_down":
        return fused
    *lead, two_i = fused.shape
    return np.swapaxes(fused.reshape(*lead, two_i // 2, 2), -1, -2)  # column 2j is gate j, 2j + 1 up j


def _expert_blocks(path: tuple[str, ...], layer: int, arch: ModelArch, get_blocks: GetBlocks) -> Parts:
    """A layer's experts kept in a GGUF's own bits: (qs, scales, mins), each `[E, K', *out]` as `_from_fused`."""
    assert arch.moe is not None
    qt = get_blocks(fused_expert_name(path, layer, arch))  # rows [E * out], every expert's
    experts = arch.moe.num_experts
    arrays = (qt.qs, qt.scales, qt.mins)
    return tuple(None if a is None else _from_fused(path, a.reshape(experts, -1, a.shape[-1])) for a in arrays)  # type: ignore[return-value]


def leaf_path(key_path) -> tuple[str, ...]:
    """A pytree key path as the tuple of its dict keys ("layers", "mlp", "down_proj", "kernel")."""
    return tuple(k.key for k in key_path)


def _assemble(parts: list[np.ndarray], is_kernel: bool, shape: tuple[int, ...]) -> np.ndarray:
    """One layer's leaf from its transformers tensors: kernels `[out, in]` → `[in, ...]`, parts on axis -2."""
    if is_kernel:
        parts = [p.T for p in parts]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([p.reshape(*shape[:-2], -1, shape[-1]) for p in parts], axis=-2)


HOST_ALIGNMENT = 64  # XLA's CPU client adopts a host array this aligned as a device buffer instead of copying it


def aligned_empty(path: tuple[str, ...], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised host array whose data starts on a HOST_ALIGNMENT boundary: on CPU, placing it on the
    device is then free (a 538 MB copy otherwise). The parameters are never donated, so sharing is safe.
    (`path`, the leaf's, is there for allocators that name what they make: `Allocate`.)"""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


Allocate = Callable[[tuple[str, ...], tuple[int, ...], np.dtype], np.ndarray]  # (leaf path, shape, dtype) → array


@dataclass(frozen=True)
class Layout:
    """A rearrangement of the parameter tree that keeps every shape and acts on each layer of a stacked leaf
    alone (packing for a kernel), so a loader can apply it layer by layer as it fills the tree. `name` keys
    the converted weights kept on disk, so a later start maps the rearranged arrays."""

    name: str
    leaf: Callable[[tuple[str, ...], Any], Any]  # (leaf path, value) → value; a stacked leaf's value is `[L, ...]`

    def apply(self, params: Params) -> Params:
        return jax.tree_util.tree_map_with_path(lambda key_path, v: self.leaf(leaf_path(key_path), v), params)


def host_params_from_hf_tensors(
    arch: ModelArch,
    dtype,
    get_tensor: GetTensor,
    source: str,
    layout: Layout | None = None,
    allocate: Allocate = aligned_empty,
    quant: QuantPlan = NO_QUANT,
    get_blocks: GetBlocks | None = None,
) -> Params:
    """The parameter tree as host arrays from `allocate`, read by transformers name and laid out by `layout`,
    one layer at a time (no second copy of the tree). Projections in `quant` are quantized from the float
    tensors ("int8", "int4"), or taken in their bits from `get_blocks` (a GGUF's kept formats)."""
    shapes, _ = abstract_params(arch, dtype, quant)
    get_tensor = _mixtral_aliases(get_tensor) if arch.architecture == "MixtralForCausalLM" else get_tensor
    quantized: dict[tuple, Parts] = {}  # the current module's quantized arrays, per layer (three leaves share them)

    def assembled(path, shape, names, is_kernel: bool) -> np.ndarray:
        parts = [np.asarray(get_tensor(name)) for name in names]
        try:
            value = _assemble(parts, is_kernel, shape)
        except ValueError:
            value = None
        if value is None or value.shape != shape:
            got = ", ".join(f"{n} {p.shape}" for n, p in zip(names, parts, strict=True))
            raise ValueError(f"{source}: tensor shapes {got} do not make {path[-2]} {shape} for {arch.architecture}")
        return value

    def quantized_leaf(path, layer, shape, names) -> np.ndarray:
        """One of a quantized weight's arrays (`path[-1]`: qweight, scales or mins) for one layer."""
        module = path[:-1]
        if (module, layer) not in quantized:
            if any(key[0] != module for key in quantized):
                quantized.clear()
            fmt = quant.get(module[-1])
            assert fmt is not None, module
            if module[-1] in EXPERT_MODULES and get_blocks is not None and fmt in GGUF_KEPT.values():
                assert layer is not None  # a GGUF's experts in their bits, never expanded
                quantized[module, layer] = _expert_blocks(path, layer, arch, get_blocks)
            elif module[-1] in EXPERT_MODULES:  # every expert quantized alone, the expert axis first
                assert layer is not None
                each = [quantize_kernel(e, fmt) for e in _expert_leaf(path, layer, arch, get_tensor)]
                stacked_parts = [None if p[0] is None else np.stack(p) for p in zip(*each, strict=True)]
                quantized[module, layer] = tuple(stacked_parts)  # type: ignore[assignment]
            elif get_blocks is not None and fmt in GGUF_KEPT.values():  # in its bits: [K', out] per part
                blocks = [from_blocks(get_blocks(name)) for name in names]
                qs, scales = ([b[i] for b in blocks] for i in range(2))
                mins = None if blocks[0][2] is None else [b[2] for b in blocks]
                joined = lambda parts: _assemble(parts, False, (parts[0].shape[0], *shape[1:]))  # noqa: E731
                quantized[module, layer] = (joined(qs), joined(scales), None if mins is None else joined(mins))
            else:
                qweight = _subtree(shapes, module)["qweight"]
                k = qweight.shape[stack_start(path[0]) is not None] * 8 // FORMATS[fmt].bits
                quantized[module, layer] = quantize_kernel(assembled(path, (k, *shape[1:]), names, True), fmt)
        value = quantized[module, layer][QUANT_LEAVES.index(path[-1])]
        assert value is not None and value.shape == shape, (path, shape)
        return value

    def load(key_path, shape):
        path = leaf_path(key_path)
        first = stack_start(path[0])  # a stack of layers from `first` on, or None
        stacked = first is not None
        layer_shape = shape.shape[1:] if stacked else shape.shape
        host = allocate(path, shape.shape, np.dtype(shape.dtype))
        for i, layer in enumerate(range(first, first + shape.shape[0]) if first is not None else [None]):
            names = hf_tensor_names_of(path, layer, arch)
            if path[-2] in EXPERT_MODULES and path[-1] not in QUANT_LEAVES:
                assert layer is not None
                value = _expert_leaf(path, layer, arch, get_tensor)
                if value.shape != layer_shape:
                    raise ValueError(
                        f"{source}: layer {layer}'s experts {value.shape} do not make {path[-2]} {layer_shape}"
                    )
            elif path[-1] in QUANT_LEAVES:
                value = quantized_leaf(path, layer, layer_shape, names)
            else:
                value = assembled(path, layer_shape, names, path[-1] == "kernel")
            value = value.astype(shape.dtype, copy=False)
            if layout is not None:
                value = layout.leaf(path, value[None])[0] if stacked else layout.leaf(path, value)
            (host[i] if stacked else host)[...] = value
        return host

    return jax.tree_util.tree_map_with_path(load, shapes)


def _subtree(tree: Params, path: tuple[str, ...]) -> Params:
    for key in path:
        tree = tree[key]
    return tree


def place(host: Params, shardings: Params) -> Params:
    """Host arrays → device arrays. Each process places only its own shards: device_put onto a multi-host mesh
    would first all-gather the whole array to check that every host holds the same value."""
    return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda index: a[index]), host, shardings)


def params_from_hf_tensors(
    arch: ModelArch,
    dtype,
    get_tensor: GetTensor,
    mesh: Mesh,
    source: str,
    layout: Layout | None = None,
    quant: QuantPlan = NO_QUANT,
) -> Params:
    """Build the device parameter tree, reading each tensor by its transformers name."""
    _, specs = abstract_params(arch, dtype, quant)
    host = host_params_from_hf_tensors(arch, dtype, get_tensor, source, layout, quant=quant)
    return place(host, param_shardings(specs, mesh))


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """Every transformers tensor name the model reads (for completeness checks)."""
    shapes, _ = abstract_params(arch, jnp.float32)
    names = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        path = leaf_path(key_path)
        first = stack_start(path[0])
        for layer in range(first, first + leaf.shape[0]) if first is not None else [None]:
            names.extend(hf_tensor_names_of(path, layer, arch))
    return names


def unstack_layers(params: Params, num_layers: int) -> Params:
    """Stacked layers `[L, ...]` ("layers", or a run of them "layers_from_N") → "layers_0".."layers_{L-1}", for
    the unrolled model.

    Each slice keeps its leaf's sharding minus the layer axis. Checkpoints and loaders always
    use the stacked form; this runs once, when an engine starts.
    """

    def take(x, i):
        return jax.device_put(x[i], NamedSharding(x.sharding.mesh, PartitionSpec(*x.sharding.spec[1:])))

    unrolled = {k: v for k, v in params.items() if stack_start(k) is None}
    for key, stack in params.items():
        if (first := stack_start(key)) is not None:
            length = jax.tree.leaves(stack)[0].shape[0]
            unrolled.update(
                {f"layers_{first + i}": jax.tree.map(lambda x, i=i: take(x, i), stack) for i in range(length)}
            )
    assert len(unrolled) - len(params) + sum(stack_start(k) is not None for k in params) == num_layers
    return unrolled


def quantize_params(params: Params, quant: QuantPlan) -> Params:
    """A float parameter tree (`[L, ...]` stacked, as checkpoints hold it) with the projections in `quant`
    quantized on the host: each float kernel (a tied embedding as the LM head's `[H, V]`) becomes its arrays."""

    def module(name: str, node: dict, stacked: bool) -> dict:
        fmt = quant.get(name)
        if fmt is None or not ({"kernel", "embedding"} & node.keys()):
            return {
                k: module(k, v, stacked or stack_start(k) is not None) if isinstance(v, dict) else v
                for k, v in node.items()
            }
        rest = {k: v for k, v in node.items() if k not in ("kernel", "embedding")}
        if "embedding" in node:
            parts = quantize_kernel(np.asarray(node["embedding"], np.float32).T, fmt)
        elif stacked:
            layers = [quantize_kernel(layer, fmt) for layer in np.asarray(node["kernel"], np.float32)]
            parts = tuple(None if p[0] is None else np.stack(p) for p in zip(*layers, strict=True))  # type: ignore[assignment]
        else:
            parts = quantize_kernel(np.asarray(node["kernel"], np.float32), fmt)
        return {**rest, **{leaf: a for leaf, a in zip(QUANT_LEAVES, parts, strict=True) if a is not None}}

    return module("", jax.device_get(params), False)

"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks each token's top-k experts.

Routing runs inside the compiled step, with no host round trip and no shape that depends on it, and it is
dropless: every token reaches its k experts. The T x k (token, expert) assignments are sorted by expert, as
`jax.lax.ragged_dot` takes them, and `grouped_swiglu` runs each expert's rows against its own weights.

`jax.lax.ragged_dot` on CPU lowers to masked dense work over every group (E times the FLOPs), so the grouped
matmul is tiled instead (model/grouped.py): each expert's rows padded to whole tiles of `m` rows, every tile one small
matmul against its expert's weights. With m = 1 (a decode step, T x k <= E) that reads exactly the experts the
tokens chose; larger steps take m ~ T x k / E, so the padding at most doubles the rows. With the CPU kernels each
expert is packed as a layer of the dense kernel's stack (float or quantized), and one call of the C++ kernel runs
every tile against its expert in place.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxllm.model.grouped import Experts, KernelExperts, flat_stack, tile_matmuls, tiling, weight_array
from jaxllm.model.layers import INIT_STD, Dtype, GatedMLP, Linear, Stacking
from jaxllm.model.quant import QUANT_LEAVES, packs_quantized, quantized_params
from jaxllm.model.registry import ModelArch
from pallas_kernels import grouped_matmul, stacked_matmul
from pallas_kernels.stacked_matmul.quantized import QuantizedWeight


def route(logits: Float[Array, "T E"], top_k: int, normalize: bool) -> tuple[Float[Array, "T K"], Int[Array, "T K"]]:
    """The chosen experts' weights and ids, as transformers computes them: softmax in float32, top-k (ties to
    the lowest expert id), renormalised to sum to one when `normalize`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


EXPERT_LOAD = "expert_load"  # what a sparse layer sows: its step's tokens per expert (`jaxllm.metrics`)


def expert_load(experts: Int[Array, "T K"], real: Array, num_experts: int) -> Int[Array, " E"]:
    """How many of the `real` tokens chose each expert."""
    counts = jnp.broadcast_to(real[:, None], experts.shape).astype(jnp.int32).reshape(-1)
    return jnp.zeros(num_experts, jnp.int32).at[experts.reshape(-1)].add(counts)


def _num_experts(gate_up) -> int:
    """E of the experts' gate_up weights `[*L, E, H, 2, I]` (float or quantized, a kernel's or not)."""
    return weight_array(gate_up.weights if isinstance(gate_up, KernelExperts) else gate_up).shape[-4]


def packs_expert_leaf(leaf: str, a) -> bool:
    """Whether "cpu_packed" packs this array of a stack of experts `[L, E, K, *N]` (and reads it packed), each
    expert as `stacked_matmul.pack` lays a layer out, so the C++ kernel reads it in place: a float "kernel"
    `packable` takes, or a quantized weight's array with N in whole panels (a dense layer's rule)."""
    if leaf in QUANT_LEAVES:
        return packs_quantized(flat_stack(a).shape)
    return leaf == "kernel" and stacked_matmul.packable(flat_stack(a))


def packs_experts(w: Experts) -> bool:
    """`packs_expert_leaf` for a whole weight, float or quantized (`CausalLM.pack_leaf` packed it so)."""
    return packs_expert_leaf("qweight", w.qs) if isinstance(w, QuantizedWeight) else packs_expert_leaf("kernel", w)


def pallas_takes(w: Experts, stacked: bool) -> bool:
    """Whether the Pallas GPU kernel multiplies these experts (float, tiled by its blocks)."""
    return not isinstance(w, QuantizedWeight) and grouped_matmul.supports(flat_stack(w) if stacked else w)


def pack_experts(a):
    """One array of a stack of experts `[L, E, K, *N]` (a float kernel, or a quantized weight's quants, scales
    or mins), each expert packed alone (same shape)."""
    return stacked_matmul.pack(flat_stack(a)).reshape(a.shape)


class ExpertBiases(NamedTuple):
    """gpt-oss: every expert's projections have biases, `[*L, E, 2, I]` and `[*L, E, H]`."""

    gate_up: Float[Array, "*L E 2 I"]
    down: Float[Array, "*L E H"]


def glu(h: Float[Array, "... 2 I"], clamped: tuple[float, float] | None) -> Float[Array, "... I"]:
    """The experts' gated activation of gate_up's output: SwiGLU, or gpt-oss's clamped form (`MoEConfig`)."""
    gate, up = h[..., 0, :], h[..., 1, :]
    if clamped is None:
        return nn.silu(gate) * up
    alpha, limit = clamped
    gate = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * gate * jax.nn.sigmoid(gate * alpha)


def grouped_swiglu(
    x: Float[Array, "T H"],
    experts: Int[Array, "T K"],
    weights: Float[Array, "T K"],
    gate_up: Experts | KernelExperts,
    down: Experts | KernelExperts,
    layer=None,
    biases: ExpertBiases | None = None,
    clamped_glu: tuple[float, float] | None = None,
) -> Float[Array, "T H"]:
    """sum over k of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, k], in float32 (the
    activation `glu`'s, and each projection plus its bias with `biases`). `gate_up` `[E, H, 2, I]`, `down`
    `[E, I, H]` (float, or their quants). `layer`: the weights are stacked `[L, E, ...]` and this layer's are read,
    only the tiles' experts of it (a slice of the layer first would copy every expert's weights each step)."""
    num_tokens, k = experts.shape
    num_experts = _num_experts(gate_up)
    hidden = x.shape[-1]
    m, num_tiles = tiling(num_tokens * k, num_experts)  # (enough tiles for any routing)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, each group in token order
    token, expert = order // k, flat[order]
    sizes = jnp.bincount(flat, length=num_experts)
    padded = (sizes + m - 1) // m * m  # each group in whole tiles
    padded_ends = jnp.cumsum(padded)
    rank = jnp.arange(num_tokens * k) - (jnp.cumsum(sizes) - sizes)[expert]  # place within its group
    dest = (padded_ends - padded)[expert] + rank  # its row in the tiled layout
    num_rows = num_tiles * m
    # each tile's expert (tiles past the last group hold zero rows; any expert will do for them)
    tile_expert = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(num_tiles) * m, side="right"), num_experts - 1)
    index = tile_expert if layer is None else (layer, tile_expert)
    rows = jnp.zeros((num_rows, hidden), jnp.float32).at[dest].set(x[token].astype(jnp.float32))
    tiles = rows.reshape(num_tiles, m, hidden)
    h = tile_matmuls(tiles, gate_up, index)
    if biases is not None:  # each tile's expert's (padding rows get one too: they are never read)
        h = h + biases.gate_up[index][:, None].astype(jnp.float32)
    y = tile_matmuls(glu(h, clamped_glu), down, index)
    if biases is not None:
        y = y + biases.down[index][:, None].astype(jnp.float32)
    y = y.reshape(num_rows, hidden)
    y = y[dest] * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((num_tokens, hidden), jnp.float32).at[token].add(y)


def expert_parallel_swiglu(mesh: Mesh, x, experts, weights, gate_up, down, layer, biases=None, clamped_glu=None):
    """`grouped_swiglu` with the experts split whole over the mesh axis "model": each device runs the assignments
    to its own experts (the others with weight zero) and the partial sums are added up. Every device reads only
    its E/N experts; none ever gathers another's."""
    stacked = layer is not None
    expert_axis = (None, "model") if stacked else ("model",)

    def local(x, experts, weights, gate_up, down, layer, biases):
        num_local = _num_experts(gate_up)
        local_id = experts - jax.lax.axis_index("model") * num_local
        mine = (local_id >= 0) & (local_id < num_local)
        ids, kept = jnp.where(mine, local_id, 0), jnp.where(mine, weights, 0)
        out = grouped_swiglu(x, ids, kept, gate_up, down, layer if stacked else None, biases, clamped_glu)
        return jax.lax.psum(out, "model")

    replicated, split = P(), P(*expert_axis)
    specs = [jax.tree.map(lambda _: split, w) for w in (gate_up, down, biases)]  # quantized weights' arrays too
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(replicated, replicated, replicated, specs[0], specs[1], replicated, specs[2]),
        out_specs=replicated,
    )(x, experts, weights, gate_up, down, layer if stacked else jnp.int32(0), biases)


class ExpertWeights(nn.Module):
    """One projection of every expert, `[E, K, *N]` (stacked over layers by `stacking`): a float "kernel", or the
    quantized arrays of model/quant.py when the plan quantizes this module, each with the expert axis first; with
    `bias` (gpt-oss) also its "bias" `[E, *N]`. Returns (the weight, its bias or None)."""

    num_experts: int
    k: int
    out_shape: tuple[int, ...]
    expert_spec: str | None  # "model": expert parallelism
    in_spec: str | None
    out_spec: tuple
    dtype: Dtype
    stacking: Stacking = Stacking()
    bias: bool = False

    @nn.compact
    def __call__(self) -> tuple[Experts, Array | None]:
        st, e = self.stacking, self.num_experts

        def declare(name, init, spec, shape, dtype):
            return st.param(self, name, init, (self.expert_spec, *spec), (e, *shape), dtype)

        bias = declare("bias", nn.initializers.zeros, self.out_spec, self.out_shape, self.dtype) if self.bias else None
        if fmt := st.quant.get(self.name):
            return quantized_params(declare, fmt, self.k, self.out_shape, self.in_spec, self.out_spec), bias
        init = nn.initializers.normal(INIT_STD)
        kernel = declare("kernel", init, (self.in_spec, *self.out_spec), (self.k, *self.out_shape), self.dtype)
        return kernel, bias


class SparseMoE(nn.Module):
    """The MLP of a mixture-of-experts layer: router ("router", `[H, E]`), the experts' stacked SwiGLU weights
    ("experts_gate_up" `[E, H, 2, I]`, "experts_down" `[E, I, H]`), and Qwen2-MoE's sigmoid-gated shared expert.
    Tensor parallelism splits each expert's I, as a dense MLP's columns; expert parallelism (`moe.expert_parallel`)
    splits E instead, whole experts per device, and runs them under `shard_map` over `expert_mesh` (None while
    only the parameters' shapes are traced)."""

    arch: ModelArch
    dtype: Dtype
    stacking: Stacking = Stacking()
    expert_mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x: Float[Array, "T H"], layer=None, num_tokens=None) -> Float[Array, "T H"]:
        moe, st, hidden = self.arch.moe, self.stacking, self.arch.hidden_size
        assert moe is not None
        e, size = moe.num_experts, moe.intermediate_size
        # the router in float32 whatever the weights' type: a rounding that flips a choice changes the output
        router = Linear((e,), shard_axis=None, dtype=jnp.float32, bias=moe.biases, stacking=st, name="router")
        logits = router(x.astype(jnp.float32), layer)
        weights, experts = route(logits, moe.top_k, moe.norm_topk_prob)
        if num_tokens is not None:  # the tokens each expert got (rows past `num_tokens` are padding): metrics
            real = jnp.arange(x.shape[0]) < num_tokens
            self.sow("intermediates", EXPERT_LOAD, expert_load(experts, real, e))
        ep = moe.expert_parallel
        # expert parallelism splits the experts; tensor parallelism each expert's I (gate_up's columns, down's rows)
        gate_up, gate_up_bias = ExpertWeights(
            e,
            hidden,
            (2, size),
            "model" if ep else None,
            None,
            (None, None if ep else "model"),
            self.dtype,
            st,
            moe.biases,
            name="experts_gate_up",
        )()
        down, down_bias = ExpertWeights(
            e,
            size,
            (hidden,),
            "model" if ep else None,
            None if ep else "model",
            (None,),
            self.dtype,
            st,
            moe.biases,
            name="experts_down",
        )()
        biases = None if gate_up_bias is None or down_bias is None else ExpertBiases(gate_up_bias, down_bias)
        weights = weights.astype(self.dtype)  # (transformers casts them to the activations' type)
        index = st.index(layer) if st.num_layers is not None else None
        packed = st.matmul_backend == "cpu_packed" and index is not None
        run_gate_up: Experts | KernelExperts = gate_up  # as the grouped matmul reads them: a kernel's, or XLA's
        run_down: Experts | KernelExperts = down
        if packed and packs_experts(gate_up) and packs_experts(down):  # (CausalLM.pack_leaf packed them)
            run_gate_up, run_down = (
                KernelExperts(w, "cpu", st.kernel_max_rows, st.int8_min_rows) for w in (gate_up, down)
            )
        elif st.expert_kernel == "pallas" and all(pallas_takes(w, index is not None) for w in (gate_up, down)):
            run_gate_up, run_down = (KernelExperts(w, "pallas") for w in (gate_up, down))
        glu_kind = moe.clamped_glu
        if ep and self.expert_mesh is not None:
            out = expert_parallel_swiglu(self.expert_mesh, x, experts, weights, gate_up, down, index, biases, glu_kind)
        else:
            out = grouped_swiglu(x, experts, weights, run_gate_up, run_down, index, biases, glu_kind)
        out = out.astype(self.dtype)
        if moe.shared_expert_intermediate_size:
            shared = GatedMLP(self.arch, self.dtype, st, moe.shared_expert_intermediate_size, name="shared_expert")
            gate = Linear((1,), shard_axis=None, dtype=self.dtype, bias=False, stacking=st, name="shared_expert_gate")
            out = out + jax.nn.sigmoid(gate(x, layer)) * shared(x, layer)
        return out

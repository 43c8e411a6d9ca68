"""Building blocks of the Llama-family decoder: RMSNorm, rotary embeddings, linear layers, gated MLP.

Every parameter carries a PartitionSpec over the mesh axis "model" (docs/design.md, Sharding):
column-parallel projections shard their output features, row-parallel ones their inputs.

Projections that read the same input are fused into one matmul, as vLLM's
QKVParallelLinear and MergedColumnParallelLinear do: one weight read and one matmul call
instead of three (q, k, v) or two (gate, up). The fused kernel keeps its parts on their
own axis, `[in, ..., parts, last]`, so that the axis sharded over "model" (KV heads, MLP
columns) is never the parts axis: each tensor-parallel shard holds whole q/k/v (or
gate/up) pieces for its own heads or columns, and no shard ever needs another's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxllm.model.lora import LoRATiles, add_lora
from jaxllm.model.quant import QuantPlan, packs_quantized, quantized_params
from jaxllm.model.registry import ModelArch, RopeConfig
from pallas_kernels.stacked_matmul import packed_matmul, packed_rows, quantized, stacked_matmul

Dtype = Any
INIT_STD = 0.02


def partitioned_param(module: nn.Module, name: str, init, spec: tuple, shape: tuple, dtype: Dtype) -> Array:
    """`module.param` with `init` partitioned by `spec`: the array itself (flax unboxes the `Partitioned`
    box its typing returns)."""
    return cast(Array, module.param(name, nn.with_partitioning(init, spec), shape, dtype))


@dataclass(frozen=True)
class Stacking:
    """Where a decoder layer's parameters live.

    `num_layers` set (the scanned model): every parameter holds all layers, `[L, ...]`, and the
    scan's body reads the layer it runs (its index rides in the carry). The body sees the whole
    stack rather than a slice handed in by the scan, so that a projection can read its layer's
    weights in place (`pallas_kernels.stacked_matmul`): XLA's CPU dot would copy the slice.
    None (the unrolled model, and everything outside the layers): each module its own arrays.
    """

    num_layers: int | None = None
    matmul_backend: str = "auto"
    kernel_max_rows: int | None = None  # "cpu_packed": XLA's dot above this many rows (stacked_matmul's)
    quant: QuantPlan = field(default_factory=QuantPlan)  # which projections (by module name) are quantized
    first_layer: int = 0  # the model's layer at index 0 of the stack (a run of layers of one kind)
    expert_kernel: str | None = None  # "pallas": a mixture of experts' grouped matmul by the Pallas kernel (one GPU)
    int8_min_rows: int = 0  # "cpu_packed": quantized weights' integer path from this many rows (0: never)

    def index(self, layer):
        """The running layer's index in the stack (the layer index in the carry counts every layer)."""
        return layer - self.first_layer

    def param(self, module: nn.Module, name: str, init, spec: tuple, shape: tuple, dtype: Dtype) -> Array:
        """The module's parameter as stored: `[L, *shape]` when stacked."""
        if self.num_layers is None:
            return partitioned_param(module, name, init, spec, shape, dtype)
        return partitioned_param(module, name, init, (None, *spec), (self.num_layers, *shape), dtype)

    def at(self, value: Array, layer) -> Array:
        """A small parameter's value for the running layer."""
        if self.num_layers is None:
            return value
        return jax.lax.dynamic_index_in_dim(value, self.index(layer), axis=0, keepdims=False)

    def matmul(self, x: Array, kernel: Array, layer) -> Array:
        """`x @ kernel` for the running layer, contracting x's last axis with the kernel's input axis."""
        if self.num_layers is None:
            return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return stacked_matmul(
            x, kernel, self.index(layer), backend=self.matmul_backend, kernel_max_rows=self.kernel_max_rows
        )

    def quantized_matmul(self, x: Array, qw: quantized.QuantizedWeight, layer, packed: bool) -> Array:
        """`x @ W` (float32) for a quantized weight: the CPU kernel on packed panels (`packed`), else XLA
        dequantizing inside the step (tensor parallelism, accelerators, kernels off). Unstacked: a stack of one."""
        index = self.index(layer) if self.num_layers is not None else 0
        if self.num_layers is None:
            qw = stack_of_one(qw)
        backend = "cpu_packed" if packed else "reference"
        return quantized.quantized_matmul(
            x, qw, index, backend=backend, kernel_max_rows=self.kernel_max_rows, int8_min_rows=self.int8_min_rows
        )


def stack_of_one(qw: quantized.QuantizedWeight) -> quantized.QuantizedWeight:
    return quantized.QuantizedWeight(qw.qs[None], qw.scales[None], None if qw.mins is None else qw.mins[None])


class Linear(nn.Module):
    """`x @ W` with a kernel `[in, *out_shape]` (the layout stored: no step reshapes or transposes it).

    Over the mesh axis "model": output axis `shard_axis` of `out_shape` (column-parallel), or
    the input axis when `shard_axis` is None (row-parallel).
    """

    out_shape: tuple[int, ...]
    shard_axis: int | None
    dtype: Dtype
    bias: bool
    stacking: Stacking = Stacking()
    packed: bool = False  # an unstacked kernel stored as `stacked_matmul.pack_matrix` lays it out
    parts_axis: int | None = None  # a fused projection: the output axis its parts (q/k/v, gate/up) lie along (LoRA)

    @nn.compact
    def __call__(self, x: Float[Array, "T H"], layer=None, lora: LoRATiles | None = None) -> Array:
        """`lora`: the step's tokens by adapter slot; with this module's "lora_a"/"lora_b" among the parameters
        (a LoRA step's), each token's adapter's low-rank product is added (model/lora.py)."""
        st = self.stacking
        in_spec = "model" if self.shard_axis is None else None
        out_spec = tuple("model" if i == self.shard_axis else None for i in range(len(self.out_shape)))
        if fmt := st.quant.get(self.name):
            qw = quantized_params(partial(st.param, self), fmt, x.shape[-1], self.out_shape, in_spec, out_spec)
            # stacked layers: packed with the float kernels (whole panels); an unstacked head: as `packed` says
            stacked_packed = st.matmul_backend == "cpu_packed" and packs_quantized(qw.qs.shape)
            packed = self.packed if st.num_layers is None else stacked_packed
            y = st.quantized_matmul(x, qw, layer, packed).astype(self.dtype)
        else:
            init = nn.initializers.normal(INIT_STD)
            kernel = st.param(self, "kernel", init, (in_spec, *out_spec), (x.shape[-1], *self.out_shape), self.dtype)
            if self.packed:
                y = packed_matmul(x, kernel, kernel_max_rows=st.kernel_max_rows)
            else:
                y = st.matmul(x.astype(self.dtype), kernel, layer)
        if self.bias:
            bias = st.param(self, "bias", nn.initializers.normal(INIT_STD), out_spec, self.out_shape, self.dtype)
            y = y + st.at(bias, layer)
        if lora is not None and self.has_variable("params", "lora_a"):
            a: Array = self.get_variable("params", "lora_a")
            bs: list[Array] = []
            while self.has_variable("params", f"lora_b{len(bs)}"):
                bs.append(self.get_variable("params", f"lora_b{len(bs)}"))
            y = add_lora(y, x, a, bs, lora, st.index(layer), self.parts_axis, st.matmul_backend == "cpu_packed")
        return y


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the scale, as transformers does; `offset` 1 (Gemma): the
    scale is 1 + weight, applied in float32 before the cast, as transformers' Gemma norms do."""

    eps: float
    dtype: Dtype
    stacking: Stacking = Stacking()
    offset: float = 0.0

    @nn.compact
    def __call__(self, x: Float[Array, "... H"], layer=None) -> Float[Array, "... H"]:
        st = self.stacking
        weight = st.at(st.param(self, "weight", nn.initializers.ones, (None,), (x.shape[-1],), self.dtype), layer)
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + weight.astype(jnp.float32))).astype(self.dtype)
        return weight * normed.astype(self.dtype)


class Embed(nn.Module):
    """Token embedding, vocabulary sharded over "model"; `attend` is the tied LM head.

    `packed`: the table is stored as `stacked_matmul.pack_matrix(E, transposed=True)` lays it out
    (same shape), so that the LM head runs through the packed kernel (measured 1.4x XLA's dot at 64
    rows, benchmarks/NOTES.md lever 12) without a second copy; a lookup gathers its strided row.
    """

    vocab_size: int
    features: int
    dtype: Dtype
    packed: bool = False
    kernel_max_rows: int | None = None  # packed: XLA's dot above this many rows (stacked_matmul's)
    quant: str | None = None  # a quantized table: stored as E.T `[H, V]` (a kernel of the LM head), model/quant.py
    int8_min_rows: int = 0  # a quantized table: the LM head's integer path from this many rows (Stacking's)

    def setup(self):
        if self.quant:
            declare = partial(partitioned_param, self)
            self.table = quantized_params(declare, self.quant, self.features, (self.vocab_size,), None, ("model",))
            return
        self.embedding = partitioned_param(
            self,
            "embedding",
            nn.initializers.normal(INIT_STD),
            ("model", None),
            (self.vocab_size, self.features),
            self.dtype,
        )

    def __call__(self, token_ids: Int[Array, " T"]) -> Float[Array, "T H"]:
        if self.quant:
            return quantized.quantized_rows(stack_of_one(self.table), token_ids, packed=self.packed, dtype=self.dtype)
        if self.packed:
            return packed_rows(self.embedding, token_ids)
        return jnp.take(self.embedding, token_ids, axis=0)

    def attend(self, x: Float[Array, "S H"]) -> Float[Array, "S V"]:
        if self.quant:  # the LM head: an unstacked quantized kernel [H, V]
            st = Stacking(kernel_max_rows=self.kernel_max_rows, int8_min_rows=self.int8_min_rows)
            return st.quantized_matmul(x, self.table, None, self.packed)
        if self.packed:
            return packed_matmul(x, self.embedding, kernel_max_rows=self.kernel_max_rows)
        # E @ x.T reads the embedding's contiguous rows; x @ E.T makes XLA (CPU) copy E transposed per step
        return (self.embedding @ x.astype(self.embedding.dtype).T).T


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up as one `[H, 2, I]` matmul. `intermediate_size`: I when
    not the arch's (a mixture of experts' shared expert)."""

    arch: ModelArch
    dtype: Dtype
    stacking: Stacking = Stacking()
    intermediate_size: int | None = None

    @nn.compact
    def __call__(self, x: Float[Array, "T H"], layer=None, lora: LoRATiles | None = None) -> Float[Array, "T H"]:
        inner = self.intermediate_size or self.arch.intermediate_size
        bias, st = self.arch.mlp_bias, self.stacking
        gate_up = Linear(
            (2, inner), shard_axis=1, dtype=self.dtype, bias=bias, stacking=st, parts_axis=0, name="gate_up_proj"
        )(x, layer, lora)
        down = Linear(
            (self.arch.hidden_size,), shard_axis=None, dtype=self.dtype, bias=bias, stacking=st, name="down_proj"
        )
        act = nn.silu if self.arch.hidden_act == "silu" else partial(nn.gelu, approximate=True)
        return down(act(gate_up[:, 0]) * gate_up[:, 1], layer, lora)


def rotary_cos_sin(
    arch: ModelArch, positions: Int[Array, " T"], dtype: Dtype, rope: RopeConfig | None = None
) -> tuple[Array, Array]:
    """cos and sin `[T, head_dim]` for the rotate-half convention, computed in float32; `rope`: another than the
    model's (Gemma 3's sliding-window layers)."""
    inv_freq, scale = (rope or arch.rope).inv_freq_and_scale(arch.max_position_embeddings)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def apply_rotary(x: Float[Array, "T N D"], cos: Float[Array, "T D"], sin: Float[Array, "T D"]) -> Float[Array, "T N D"]:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def as_numpy_dtype(dtype: Dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))

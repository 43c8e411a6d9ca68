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

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxllm.model.registry import ModelArch

Dtype = Any
INIT_STD = 0.02


def linear(features: int, *, name: str, dtype: Dtype, bias: bool, shard: str) -> nn.Dense:
    """A Dense layer whose kernel is `[in, out]`; `shard` is "column" (out over "model") or "row"."""
    spec = (None, "model") if shard == "column" else ("model", None)
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nn.with_partitioning(nn.initializers.normal(INIT_STD), spec),
        bias_init=nn.with_partitioning(nn.initializers.normal(INIT_STD), (spec[1],)),
        name=name,
    )


class FusedLinear(nn.Module):
    """`x @ W` with a kernel `[in, *out_shape]` whose axis `shard_axis` of `out_shape` is over "model".

    The contraction runs straight on the stored layout (a dot_general over the first kernel
    axis), so no step reshapes or transposes the weights.
    """

    out_shape: tuple[int, ...]
    shard_axis: int
    dtype: Dtype
    bias: bool

    @nn.compact
    def __call__(self, x: Float[Array, "T H"]) -> Array:
        out_spec = tuple("model" if i == self.shard_axis else None for i in range(len(self.out_shape)))
        init = nn.initializers.normal(INIT_STD)
        kernel = self.param("kernel", nn.with_partitioning(init, (None, *out_spec)),
                            (x.shape[-1], *self.out_shape), self.dtype)
        y = jax.lax.dot_general(x.astype(self.dtype), kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if self.bias:
            y = y + self.param("bias", nn.with_partitioning(init, out_spec), self.out_shape, self.dtype)
        return y


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the scale, as transformers does."""

    eps: float
    dtype: Dtype

    @nn.compact
    def __call__(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        weight = self.param("weight", nn.with_partitioning(nn.initializers.ones, (None,)), (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return weight * normed.astype(self.dtype)


class Embed(nn.Module):
    """Token embedding, vocabulary sharded over "model"; `attend` is the tied LM head."""

    vocab_size: int
    features: int
    dtype: Dtype

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_partitioning(nn.initializers.normal(INIT_STD), ("model", None)),
            (self.vocab_size, self.features),
            self.dtype,
        )

    def __call__(self, token_ids: Int[Array, "T"]) -> Float[Array, "T H"]:
        return jnp.take(self.embedding, token_ids, axis=0)

    def attend(self, x: Float[Array, "S H"]) -> Float[Array, "S V"]:
        # E @ x.T reads the embedding's contiguous rows; x @ E.T makes XLA (CPU) copy E transposed per step
        return (self.embedding @ x.T).T


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up as one `[H, 2, I]` matmul."""

    arch: ModelArch
    dtype: Dtype

    @nn.compact
    def __call__(self, x: Float[Array, "T H"]) -> Float[Array, "T H"]:
        inner, bias = self.arch.intermediate_size, self.arch.mlp_bias
        gate_up = FusedLinear((2, inner), shard_axis=1, dtype=self.dtype, bias=bias, name="gate_up_proj")(x)
        return linear(self.arch.hidden_size, name="down_proj", dtype=self.dtype, bias=bias, shard="row")(
            nn.silu(gate_up[:, 0]) * gate_up[:, 1]
        )


def rotary_cos_sin(arch: ModelArch, positions: Int[Array, "T"], dtype: Dtype) -> tuple[Array, Array]:
    """cos and sin `[T, head_dim]` for the rotate-half convention, computed in float32."""
    inv_freq, scale = arch.rope.inv_freq_and_scale(arch.max_position_embeddings)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def apply_rotary(x: Float[Array, "T N D"], cos: Float[Array, "T D"], sin: Float[Array, "T D"]) -> Float[Array, "T N D"]:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def as_numpy_dtype(dtype: Dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))

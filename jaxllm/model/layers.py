"""Building blocks of the Llama-family decoder: RMSNorm, rotary embeddings, linear layers, gated MLP.

Every parameter carries a PartitionSpec over the mesh axis "model" (DESIGN.md, Sharding):
column-parallel projections shard their output features, row-parallel ones their inputs.
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
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    arch: ModelArch
    dtype: Dtype

    @nn.compact
    def __call__(self, x: Float[Array, "T H"]) -> Float[Array, "T H"]:
        inner, bias = self.arch.intermediate_size, self.arch.mlp_bias
        gate = linear(inner, name="gate_proj", dtype=self.dtype, bias=bias, shard="column")(x)
        up = linear(inner, name="up_proj", dtype=self.dtype, bias=bias, shard="column")(x)
        return linear(self.arch.hidden_size, name="down_proj", dtype=self.dtype, bias=bias, shard="row")(
            nn.silu(gate) * up
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

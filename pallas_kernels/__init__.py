"""Attention kernels for jaxllm's paged KV cache.

`ragged_paged_attention` is the one entry point the model calls; `backend` picks the
implementation ("auto": the Pallas kernel on GPU/TPU, the pure-jnp reference on CPU).
`write_kv` scatters a step's new keys and values into the cache by slot.

The cache may be one layer `[num_blocks, block_size, Hkv, D]` or all layers stacked
`[L, num_blocks, block_size, Hkv, D]` with `layer` selecting one: the model scans over
layers with the whole cache as loop state, and slicing a layer out of it would copy it.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

BACKENDS = ("auto", "reference", "pallas")


def ragged_paged_attention(
    q: Float[Array, "T Hq D"],
    k_cache: Float[Array, "*L N B Hkv D"],
    v_cache: Float[Array, "*L N B Hkv D"],
    kv_lens: Int[Array, "S"],
    block_tables: Int[Array, "S M"],
    cu_q_lens: Int[Array, "S1"],
    num_seqs: Int[Array, "1"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    layer: Int[Array, ""] | int | None = None,
    backend: str = "auto",
) -> Float[Array, "T Hq D"]:
    """Causal attention of a flattened ragged batch over a paged KV cache.

    Sequence i owns query rows `cu_q_lens[i]:cu_q_lens[i+1]`; its last query sits at
    position `kv_lens[i] - 1` and its keys live in the blocks `block_tables[i]`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "reference" if jax.default_backend() == "cpu" else "pallas"
    if backend == "pallas":
        raise NotImplementedError("the Pallas backend is not built yet")
    return ragged_paged_attention_reference(
        q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, layer=layer,
    )


def write_kv(
    k_cache: Float[Array, "*L N B Hkv D"],
    v_cache: Float[Array, "*L N B Hkv D"],
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, "T"],
    layer: Int[Array, ""] | int | None = None,
):
    """Scatter new K/V rows into the cache at `slot = block * block_size + offset`.

    Padding rows point at a scratch slot. Done on a donated cache this updates in place.
    """
    block_size = k_cache.shape[-3]
    index = (slot_mapping // block_size, slot_mapping % block_size)
    if layer is not None:
        index = (layer, *index)
    k_cache = k_cache.at[index].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[index].set(v.astype(v_cache.dtype))
    return k_cache, v_cache

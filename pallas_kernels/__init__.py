"""Attention kernels for jaxllm's paged KV cache.

`ragged_paged_attention` is the one entry point the model calls; `backend` picks the
implementation ("auto": the Pallas kernel on GPU, the C++ kernel on CPU).
`write_kv` scatters a step's new keys and values into the cache by slot.

Backends: "reference" (pure jnp, `ragged_paged_attention/reference.py`: the oracle, and the
fallback), "pallas" (the Pallas Triton kernel, `ragged_paged_attention/triton_gpu.py`,
compiled on NVIDIA GPUs and run in interpret mode elsewhere), "cpu" (an XLA FFI custom
call in C++, `ragged_paged_attention/cpu.py`, built on first use: XLA's CPU gather cannot
read paged blocks at memory speed) and "auto": Pallas on GPU; the reference on TPU, which
has no kernel of ours yet; on CPU, the C++ kernel when it builds and the cache is float32
or bfloat16 (decode, prefill and mixed batches alike: measured faster than the reference on
each, `benchmarks/NOTES.md`), else the reference.
The reference and Pallas share the host-side tile plan (`ragged_paged_attention/plan.py`).
Head layouts the Triton kernel cannot tile (a head_dim or block_size that is not a power of
two) fall back to the reference under "auto" and raise under "pallas".

The cache may be one layer `[num_blocks, block_size, Hkv, D]` or all layers stacked
`[L, num_blocks, block_size, Hkv, D]` with `layer` selecting one: the model scans over
layers with the whole cache as loop state, and slicing a layer out of it would copy it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention import cpu
from pallas_kernels.ragged_paged_attention.cpu import ragged_paged_attention_cpu
from pallas_kernels.ragged_paged_attention.plan import check_inputs
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

BACKENDS = ("auto", "reference", "pallas", "cpu")


def ragged_paged_attention(
    q: Float[Array, "T Hq D"],
    k_cache: Float[Array, "*L N B Hkv D"],
    v_cache: Float[Array, "*L N B Hkv D"],
    kv_lens: Int[Array, " S"],
    block_tables: Int[Array, "S M"],
    cu_q_lens: Int[Array, " S1"],
    num_seqs: Int[Array, " 1"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Float[Array, " Hq"] | None = None,
    layer: Int[Array, ""] | int | None = None,
    backend: str = "auto",
) -> Float[Array, "T Hq D"]:
    """Causal attention of a flattened ragged batch over a paged KV cache.

    Sequence i owns query rows `cu_q_lens[i]:cu_q_lens[i+1]`; its last query sits at
    position `kv_lens[i] - 1` and its keys live in the blocks `block_tables[i]`. `sinks`: a learned logit per query
    head that joins each row's softmax denominator and attends to nothing (gpt-oss's attention sinks).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_inputs(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, layer)
    platform = jax.default_backend()
    args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    if backend == "auto":
        if platform == "gpu":
            backend = "pallas" if _triton_supports(q, k_cache, layer) else "reference"
        else:
            backend = "cpu" if _cpu_kernel_serves(k_cache) else "reference"
    if backend == "pallas" and platform == "tpu":
        raise NotImplementedError("no Pallas TPU kernel yet: use backend='reference' on TPU")
    kernel: Callable[..., Array]
    if backend == "pallas":
        from pallas_kernels.ragged_paged_attention.triton_gpu import ragged_paged_attention_triton

        kernel = functools.partial(ragged_paged_attention_triton, interpret=platform != "gpu")
    else:
        kernel = ragged_paged_attention_cpu if backend == "cpu" else ragged_paged_attention_reference
    return kernel(*args, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, layer=layer)


def _cpu_kernel_serves(k_cache) -> bool:
    """ "auto" on this platform runs the C++ kernels (attention and the KV write)."""
    return jax.default_backend() == "cpu" and cpu.supports(k_cache) and cpu.available()


def _triton_supports(q, k_cache, layer) -> bool:
    from pallas_kernels.ragged_paged_attention.triton_gpu import supports

    return supports(q, k_cache, layer)


def write_kv(
    k_cache: Float[Array, "*L N B Hkv D"],
    v_cache: Float[Array, "*L N B Hkv D"],
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, " T"],
    layer: Int[Array, ""] | int | None = None,
    backend: str = "auto",
):
    """Scatter new K/V rows into the cache at `slot = block * block_size + offset`.

    Padding rows point at a scratch slot. Done on a donated cache this updates in place.
    `backend` as `ragged_paged_attention`'s: where that picks the C++ kernel, a C++ row copy (XLA's
    CPU scatter is a loop of one dynamic-update-slice per row); else jnp.
    """
    if backend == "cpu" or (backend == "auto" and _cpu_kernel_serves(k_cache)):
        return cpu.write_kv_cpu(k_cache, v_cache, k, v, slot_mapping, layer)
    block_size = k_cache.shape[-3]
    index: tuple = (slot_mapping // block_size, slot_mapping % block_size)
    if layer is not None:
        index = (layer, *index)
    k_cache = k_cache.at[index].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[index].set(v.astype(v_cache.dtype))
    return k_cache, v_cache

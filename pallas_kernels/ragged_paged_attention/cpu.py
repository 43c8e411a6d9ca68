"""The CPU kernel: ragged paged attention as an XLA FFI custom call written in C++.

Why not jnp: XLA's CPU gather emitter copies ~2.5-3 GB/s however the paged read is phrased
(a gather of whole [B, Hkv, D] blocks, of flat rows, with `promise_in_bounds`, in a loop of
small gathers), while a dynamic-slice or a plain reduction reads ~20-26 GB/s on the same
machine; and a loop that reads blocks with dynamic slices pays XLA's per-op overhead on tiny
einsums (measured slower than the reference; `benchmarks/NOTES.md`, "Decode attention (CPU)").
A paged read is a pointer chase plus a few dot products per key: plain C++ does it at memory
speed, as vLLM's CPU backend does.

`cpu_kernel.cc` is compiled on first use (`pallas_kernels/cpu_ffi.py`). Without a compiler
`available()` is False and "auto" dispatch keeps the jnp reference.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi

TARGET = "jaxllm_ragged_paged_attention_cpu"
WRITE_TARGET = "jaxllm_write_kv_cpu"
SOURCE = Path(__file__).with_name("cpu_kernel.cc")


def supports(k_cache) -> bool:
    return jnp.dtype(k_cache.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def available() -> bool:
    """Build (once per machine) and register the kernels; False, with a warning, if that fails."""
    return cpu_ffi.register(SOURCE, "RaggedPagedAttentionCpu", TARGET) and cpu_ffi.register(
        SOURCE, "WriteKvCpu", WRITE_TARGET
    )


def ragged_paged_attention_cpu(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks=None,
    layer=None,
):
    """The reference's contract; caches float32 or bfloat16; computes in float32."""
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built (see the warning above)")
    if not supports(k_cache):
        raise ValueError(f"the CPU kernel reads float32 or bfloat16 caches, got {k_cache.dtype}")
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        i32(kv_lens),
        i32(block_tables),
        i32(cu_q_lens),
        jnp.reshape(i32(num_seqs), (-1,))[:1],
        jnp.reshape(i32(0 if layer is None else layer), (1,)),
        jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(-1),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )
    return out.astype(q.dtype)


def write_kv_cpu(k_cache, v_cache, k, v, slot_mapping, layer=None):
    """`write_kv`'s contract in one row copy per token (XLA's CPU scatter is a loop of ~10 thunks per
    row); the caches alias the outputs, so a donated cache is written in place."""
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built (see the warning above)")
    if not supports(k_cache):
        raise ValueError(f"the CPU kernel writes float32 or bfloat16 caches, got {k_cache.dtype}")
    shapes = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    return jax.ffi.ffi_call(WRITE_TARGET, shapes, input_output_aliases={0: 0, 1: 1})(
        k_cache,
        v_cache,
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        jnp.asarray(slot_mapping, jnp.int32),
        jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,)),
    )

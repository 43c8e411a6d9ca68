"""LoRA's shrink and expand fused into one C++ call per projection (punica's SGMV, for the CPU).

`add_lora(y, x, a, bs, slots, layer)` returns y plus, for every token whose slot is not 0, `(x @ A[slot]) @ B[slot]`
of the running layer, for every part of a fused projection at once (cpu_kernel.cc's AddLoraCpu, lora_rows.h). The
grouped matmul it replaces (a gather of the rows, one kernel call for the shrink and one per part for the expand, a
concatenation, a gather back and an add) cost a decode step 11 calls a layer, which at batch 1 cost more than the
adapter's bytes (benchmarks/results/lora_cpu.json). Slot 0 tokens (no adapter, a bucket's padding) are skipped, not
multiplied by zeros. A call large enough for both cores (`TEAM_MACS`) updates y in place (aliased to the output); a
smaller one, which runs on one thread, writes its product into zeros that are added to y after: the call then does
not wait on the projection's matmul, and XLA may run it beside that matmul on the other core (Q4_1 base, batch 1,
one adapter: ~+3 % tok/s, benchmarks/results/lora_cpu_avx2.json).

Layouts (model/lora.py): a `[L, S, Rw, K]` (PEFT's `[r, in]` per part), each part's b `[L, S, r, *part]`, float32,
float16 or bfloat16 (widened as read); the parts joined along `parts_axis` of y's trailing shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_ffi
from pallas_kernels.stacked_matmul import SOURCE

TARGET = "jaxllm_add_lora_cpu"
WIDEST_VECTOR = 16  # float32 lanes of the widest target (AVX-512): K and each part's columns come in whole vectors
TEAM_MACS = 1 << 18  # lora_rows.h's kLoraTeamFlops: a shrink of fewer multiply-adds stays on the calling thread


def available() -> bool:
    return cpu_ffi.register(SOURCE, "AddLoraCpu", TARGET)


def _outer(part_shape: tuple[int, ...], parts_axis: int | None) -> int:
    """The output's extent before the parts' axis: each part's columns repeat that many times in a row of y."""
    return 1 if parts_axis is None else math.prod(part_shape[:parts_axis])


def applies(a, bs: list, parts_axis: int | None) -> bool:
    """Whether the kernel takes these slots: on CPU, K and every part's columns in whole vectors, built."""
    outer = _outer(bs[0].shape[3:], parts_axis)
    cols = [math.prod(b.shape[3:]) // outer for b in bs]
    whole = a.shape[-1] % WIDEST_VECTOR == 0 and all(c % WIDEST_VECTOR == 0 for c in cols)
    return (
        jax.default_backend() == "cpu" and whole and a.dtype in (jnp.float32, jnp.float16, jnp.bfloat16) and available()
    )


def add_lora(
    y: Float[Array, "T ..."],
    x: Float[Array, "T K"],
    a,
    bs: list,
    slots: Int[Array, " T"],
    layer,
    parts_axis: int | None,
) -> Float[Array, "T ..."]:
    """y (float32) plus each token's `(x @ a[layer, slot]) @ b[layer, slot]`, every part of `bs` into its region."""
    num_tokens = x.shape[0]
    flat = jnp.reshape(y.astype(jnp.float32), (num_tokens, -1))
    beside = num_tokens * a.shape[-2] * a.shape[-1] < TEAM_MACS  # one thread: free it from the matmul's output
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(flat.shape, jnp.float32), input_output_aliases={1: 0})
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out = call(
        x.astype(jnp.float32),
        jnp.zeros_like(flat) if beside else flat,
        slots.astype(jnp.int32),
        layer,
        a,
        *bs,
        outer=_outer(bs[0].shape[3:], parts_axis),
    )
    return jnp.reshape(flat + out if beside else out, y.shape)

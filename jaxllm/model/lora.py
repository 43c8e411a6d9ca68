"""LoRA in the step: each projection an adapter targets adds `(x @ A[slot]) @ B[slot]` for every token's slot.

Adapters live in fixed slots, `[L, S, ...]` per projection beside its weights ("lora_a" `[L, S, R, K]` and, per part
of a fused projection, "lora_b<p>" `[L, S, r, *part]`, the scaling folded into B; slot 0 holds zeros: no adapter;
runner/lora_slots.py), so loading or swapping one never changes a shape. With the CPU kernels one C++ call per
projection groups the tokens by slot and adds every part's product in place, skipping slot 0
(pallas_kernels/stacked_matmul/lora.py). Elsewhere the tokens are grouped by slot on the host, each group padded to
whole tiles of `m` rows (`tile_tokens`: one grouping serves every layer), and every tile is one small matmul against
its own slot's A, then B, XLA gathering each tile's slot: a grouped (SGMV-like) product that reads only the adapters
in the step. A step without adapters runs the forward compiled without these terms (runner/model_runner.py).
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxllm.model.grouped import take_experts, tile_matmuls, tiling
from pallas_kernels.stacked_matmul import lora as lora_kernel

# numpy as the host fills them, jax arrays (or their shapes, at warm-up) inside the compiled step
ArrayT = TypeVar("ArrayT", Array, np.ndarray, jax.ShapeDtypeStruct)


class LoRATiles(NamedTuple, Generic[ArrayT]):
    """A step's tokens grouped by adapter slot (`tile_tokens`)."""

    slots: Int[ArrayT, " T"]  # each token's slot (the CPU kernel groups them itself)
    src: Int[ArrayT, " R"]  # each row of the tiled layout's token (padding rows: any, their results go unread)
    dest: Int[ArrayT, " T"]  # each token's row in the tiled layout
    tile_slots: Int[ArrayT, " N"]  # each tile's slot


def tile_tokens(slots: np.ndarray, num_slots: int) -> LoRATiles[np.ndarray]:
    """The tiles of tokens with adapter `slots` [T]: tokens of one slot in consecutive rows, each slot's rows in
    whole tiles; tiles past the last group compute slot 0's zeros."""
    num_tokens = len(slots)
    m, num_tiles = tiling(num_tokens, num_slots)
    sizes = np.bincount(slots, minlength=num_slots)
    padded = -(-sizes // m) * m
    starts = np.cumsum(padded) - padded
    order = np.argsort(slots, kind="stable")
    rank = np.arange(num_tokens) - (np.cumsum(sizes) - sizes)[slots[order]]
    dest = np.empty(num_tokens, np.int32)
    dest[order] = starts[slots[order]] + rank
    tile_slots = np.zeros(num_tiles, np.int32)
    tile_of_slot = np.repeat(np.arange(num_slots), padded // m)
    tile_slots[: len(tile_of_slot)] = tile_of_slot
    src = np.zeros(num_tiles * m, np.int32)  # (a gather: XLA's CPU scatter is a loop per row)
    src[dest] = np.arange(num_tokens)
    return LoRATiles(slots.astype(np.int32), src, dest, tile_slots)


def add_lora(
    y: Float[Array, "T ..."],
    x: Float[Array, "T K"],
    a,
    bs: list,
    tiles: LoRATiles,
    layer,
    parts_axis: int | None,
    cpu_kernel: bool,
) -> Float[Array, "T ..."]:
    """y plus each token's `(x @ A[slot]) @ B[slot]` of the running `layer` (an index into the stacks). `bs`: B of
    each part of a fused projection, their outputs joined along `parts_axis` of the output; `cpu_kernel`: the model
    runs the CPU kernels, so the fused C++ call where it takes these shapes."""
    if cpu_kernel and lora_kernel.applies(a, bs, parts_axis):
        return lora_kernel.add_lora(y, x, a, bs, tiles.slots, layer, parts_axis).astype(y.dtype)
    return y + lora_delta(x, a, bs, tiles, layer, parts_axis).astype(y.dtype)


def lora_delta(
    x: Float[Array, "T K"], a, bs: list, tiles: LoRATiles, layer, parts_axis: int | None
) -> Float[Array, "T ..."]:
    """Each token's `(x @ A[slot]) @ B[slot]`, float32, tile by tile, XLA gathering each tile's slot."""
    num_tokens, k = x.shape
    m, num_tiles = tiling(num_tokens, a.shape[1])
    rows = x.astype(jnp.float32)[tiles.src].reshape(num_tiles, m, k)
    index = (layer, tiles.tile_slots)
    h = jnp.einsum("tmk,trk->tmr", rows, take_experts(a, index))
    r = bs[0].shape[2]  # each part's rank columns: r apart in h
    ys = [tile_matmuls(h[..., p * r : (p + 1) * r], wb, index) for p, wb in enumerate(bs)]
    y = ys[0] if parts_axis is None else jnp.concatenate(ys, axis=2 + parts_axis)
    return y.reshape(num_tiles * m, *y.shape[2:])[tiles.dest]

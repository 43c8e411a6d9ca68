"""LoRA in the step: each projection an adapter targets adds `(x @ A[slot]) @ B[slot]` for every token's slot.

Adapters live in fixed slots, `[L, S, ...]` per projection beside its weights ("lora_a" `[L, S, K, R]` and, per part
of a fused projection, "lora_b<p>" `[L, S, r, *part]`, the scaling folded into B; slot 0 holds zeros: no adapter;
runner/lora_slots.py), so loading or swapping one never changes a shape. A step's tokens are grouped by slot and
each group padded to whole tiles of `m` rows (`tile_tokens`, on the host: one grouping serves every layer), and
every tile is one small matmul against its own slot's A, then B: a grouped (SGMV-like) product that reads only the
adapters in the step. With the CPU kernels the tiles run in one call of the grouped kernel on slots packed for it
(model/grouped.py); elsewhere XLA gathers each tile's slot. A step without adapters runs the forward compiled
without these terms (runner/model_runner.py).
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxllm.model.grouped import KernelExperts, tile_matmuls, tiling
from pallas_kernels import stacked_matmul

# numpy as the host fills them, jax arrays (or their shapes, at warm-up) inside the compiled step
ArrayT = TypeVar("ArrayT", Array, np.ndarray, jax.ShapeDtypeStruct)


class LoRATiles(NamedTuple, Generic[ArrayT]):
    """A step's tokens grouped by adapter slot (`tile_tokens`)."""

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
    return LoRATiles(src, dest, tile_slots)


def rank_width(parts: int, max_rank: int) -> int:
    """A projection's rank columns in its slots: `parts` (q/k/v: 3, gate/up: 2) of `max_rank`, rounded up to whole
    panels so that the CPU kernel reads A packed."""
    return -(-parts * max_rank // stacked_matmul.PANEL) * stacked_matmul.PANEL


def lora_delta(
    x: Float[Array, "T K"],
    a,
    bs: list,
    tiles: LoRATiles,
    layer,
    kernel_max_rows: int | None,
    packed: list[bool],
    parts_axis: int | None,
) -> Float[Array, "T ..."]:
    """Each token's `(x @ A[slot]) @ B[slot]` of the running `layer` (an index into the stacks), float32. `bs`: B of
    each part of a fused projection, their outputs joined along `parts_axis` of the output; `packed`: for A, then
    each B, whether it is packed for the CPU kernel (`stacked_matmul.pack` of each layer's slot)."""
    num_tokens, k = x.shape
    m, num_tiles = tiling(num_tokens, a.shape[1])
    rows = x.astype(jnp.float32)[tiles.src].reshape(num_tiles, m, k)
    index = (layer, tiles.tile_slots)
    wa, *wbs = (KernelExperts(w, "cpu", kernel_max_rows) if p else w for w, p in zip([a, *bs], packed, strict=True))
    h = tile_matmuls(rows, wa, index)
    r = bs[0].shape[2]  # each part's rank columns: r apart in h
    ys = [tile_matmuls(h[..., p * r : (p + 1) * r], wb, index) for p, wb in enumerate(wbs)]
    y = ys[0] if parts_axis is None else jnp.concatenate(ys, axis=2 + parts_axis)
    return y.reshape(num_tiles * m, *y.shape[2:])[tiles.dest]

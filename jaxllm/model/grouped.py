"""The grouped matmul: tiles of rows, each times its own member of a stack of weights (a mixture of experts'
experts, LoRA adapters' slots), reading only the members the tiles name.

Rows are grouped by member and each group padded to whole tiles of `m` rows (`tile_rows`); every tile is one small
matmul against its member. With the CPU kernels ("cpu_packed") the members are packed as layers of the dense
kernel's stack (float or quantized) and one call of the C++ kernel runs every tile in place (`KernelExperts`); on
one GPU the Pallas grouped kernel does the same for float members; elsewhere XLA gathers each tile's member
(dequantized after the gather when kept in its quants).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels import grouped_matmul, stacked_matmul
from pallas_kernels.stacked_matmul import quantized
from pallas_kernels.stacked_matmul.quantized import QuantizedWeight

MAX_TILE_ROWS = 64

Experts = Float[Array, "..."] | QuantizedWeight  # one projection of every member, [*L, E, K, *N]: float or quantized


def tile_rows(num_rows: int, num_members: int) -> int:
    """Rows per tile for `num_rows` rows over `num_members` groups: a power of two near the mean group."""
    mean = num_rows // num_members
    return 1 if mean <= 1 else min(MAX_TILE_ROWS, 1 << (mean.bit_length() - 1))


def tiling(num_rows: int, num_members: int) -> tuple[int, int]:
    """(rows a tile, tiles) for `num_rows` rows over `num_members` groups: enough tiles for any grouping (each group
    padded to whole tiles wastes under one)."""
    m = tile_rows(num_rows, num_members)
    return m, -(-(num_rows + num_members * (m - 1)) // m)


def weight_array(w: Experts):
    """The array whose shape a weight has: a quantized weight's quants."""
    return w.qs if isinstance(w, QuantizedWeight) else w


def flat_stack(a):
    """`[L, E, K, *N]` → `[L * E, K, *N]`: every member a "layer" of one stack."""
    return a.reshape(-1, *a.shape[2:])


def take_experts(w: Experts, index) -> Float[Array, "S K ..."]:
    """The members `index` picks (a member id per tile, with the layer first when stacked) as float32: a
    quantized stack is dequantized after the gather, so only the chosen members ever leave their bits."""
    if isinstance(w, QuantizedWeight):
        mins = None if w.mins is None else w.mins[index]
        return quantized.dequantize_each(QuantizedWeight(w.qs[index], w.scales[index], mins))
    return w[index].astype(jnp.float32)


class KernelExperts(NamedTuple):
    """Members a kernel multiplies in place, every tile in one call, never copying a weight (a gather copies every
    member a step touches): "cpu", the C++ kernel on members packed for it, float or quantized (`pack_experts`);
    "pallas", the Pallas GPU kernel (pallas_kernels/grouped_matmul) on float members as stored."""

    weights: Float[Array, "*L E K N"] | QuantizedWeight
    kernel: str
    kernel_max_rows: int | None = None  # "cpu": XLA above this many rows a tile (the self-check's)
    int8_min_rows: int = 0  # "cpu", quantized members: the integer path from this many rows a run (the same's)


def tile_matmuls(tiles, w: Experts | KernelExperts, index) -> Float[Array, "S M N"]:
    """Each tile's rows times its member: `index` a member id per tile (with the layer first when stacked)."""
    if not isinstance(w, KernelExperts):
        return jnp.einsum("tmk,tk...->tm...", tiles, take_experts(w, index))
    stacked = isinstance(index, tuple)  # (layer, member): `[L, E, ...]`, each member a "layer" of one stack
    ids = index[0] * weight_array(w.weights).shape[1] + index[1] if stacked else index
    flat = jax.tree.map(flat_stack, w.weights) if stacked else w.weights
    if w.kernel == "pallas":
        assert not isinstance(flat, QuantizedWeight)  # (`pallas_takes`: float members only)
        return grouped_matmul.grouped_matmul(tiles, flat, ids)
    if isinstance(flat, QuantizedWeight):
        return quantized.grouped_quantized_matmul(
            tiles, flat, ids, kernel_max_rows=w.kernel_max_rows, int8_min_rows=w.int8_min_rows
        )
    return stacked_matmul.grouped_matmul(tiles, flat, ids, kernel_max_rows=w.kernel_max_rows)

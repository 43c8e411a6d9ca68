"""KV cache groups: which layers share a block table, and where each layer's K/V lives (vLLM's hybrid KV cache).

A sliding-window layer reads only the last `window` keys, so its blocks can go back to the pool once they leave the
window; a full-attention layer keeps every block. Layers are grouped by attention kind, and each kind's layers are
cut into groups of `slots` layers (vLLM's rule: `slots` is the fewest layers any kind has). The cache is
`[slots, num_blocks, block_size, kv_heads, head_dim]`: one block id holds one layer's K/V in every slot, so all
groups draw from one pool, and a block a windowed group frees serves any group. Layer `l` reads and writes slot
`layer_slots[l]` through group `layer_groups[l]`'s block table. One group of every layer (`uniform`) is the cache of
a model whose layers all attend alike, and of any model when the hybrid manager is off.

Part of the step contract (the scheduler's KV manager and the runner size from it): pure Python, no JAX.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SCRATCH_BLOCK = 0  # block 0 never holds a request's KV: padding tokens write there, freed table entries point there


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window; None: full attention (keeps every block)
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: its slot, the cache's leading index
    slots: int  # layers a block holds: the cache's leading axis

    @classmethod
    def uniform(cls, num_layers: int, window: int | None = None) -> KVCacheGroups:
        """One group of every layer, each in its own slot: the cache as a model of one attention kind has it."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def plan(cls, layer_windows: Sequence[int | None], max_model_len: int, hybrid: bool = True) -> KVCacheGroups:
        """Groups for layers with these sliding windows (None: full attention). A window that covers
        `max_model_len` is full attention; `hybrid=False`: one group whose blocks are all kept."""
        windows = [None if w is None or w >= max_model_len else w for w in layer_windows]
        if any(w is not None and w >= max_model_len for w in layer_windows):
            logger.info("sliding window covers max_model_len=%d: those layers keep every block", max_model_len)
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        if not hybrid or len(kinds) == 1:
            return cls.uniform(len(windows), windows[0] if hybrid and windows else None)
        slots = min(len(layers) for layers in kinds.values())
        group_windows: list[int | None] = []
        layer_groups, layer_slots = [0] * len(windows), [0] * len(windows)
        for window, layers in kinds.items():
            for start in range(0, len(layers), slots):
                for slot, layer in enumerate(layers[start : start + slots]):
                    layer_groups[layer], layer_slots[layer] = len(group_windows), slot
                group_windows.append(window)
        return cls(tuple(group_windows), tuple(layer_groups), tuple(layer_slots), slots)

    def stage(self, start: int, end: int) -> KVCacheGroups:
        """Layers `start:end` (a pipeline stage, with a cache of its own): every group kept (the block tables are
        the scheduler's), each group's layers here in slots of their own from 0."""
        groups = self.layer_groups[start:end]
        slots = tuple(groups[:i].count(g) for i, g in enumerate(groups))
        return KVCacheGroups(self.windows, groups, slots, max(slots, default=-1) + 1)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1 or self.windows[0] is not None

    @property
    def key(self) -> str:
        """Canonical: each layer's group, each group's window (what makes two engines' blocks interchangeable)."""
        return f"layers {list(self.layer_groups)} windows {list(self.windows)}"

    def describe(self) -> str:
        """For the ready line: "" for one full-attention group, else the groups and their windows."""
        if not self.is_hybrid:
            return ""
        windowed = sorted({w for w in self.windows if w is not None})
        kinds = [f"{self.windows.count(w)} of a {w}-token window" for w in windowed]
        kinds += [f"{self.windows.count(None)} full attention"] if None in self.windows else []
        return f"{self.num_groups} KV cache groups of {self.slots} layers ({', '.join(kinds)})"

    def blocks_needed(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        return blocks_needed(self.windows, num_tokens, block_size, step_tokens)


def blocks_needed(windows: Sequence[int | None], num_tokens: int, block_size: int, step_tokens: int) -> int:
    """Blocks one request of `num_tokens` holds at most, over groups of these windows, computing `step_tokens` per
    step: every block for full attention, its window and the step's tokens (+1 at the boundary) for a windowed one."""
    total = -(-num_tokens // block_size)
    return sum(total if w is None else min(total, -(-(w - 1 + step_tokens) // block_size) + 1) for w in windows)

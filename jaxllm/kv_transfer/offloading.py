"""OffloadingConnector: blocks evicted from the device prefix cache wait in a host-memory LRU and come back on a
hit (vLLM's `--kv-offloading-size`).

Only evicted blocks are copied out, when the block manager hands their block to someone else and before the
step that overwrites it runs; a new request whose prefix continues in host memory past the device cache's hits
has those blocks scattered back into its freshly allocated blocks before its first step. Host blocks are
bounded by `num_cpu_blocks` (or `kv_offloading_size` GiB); the least recently used goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.engine.block_hash import BlockKey
from jaxllm.kv_transfer.base import BlockTables, HostLoad, KVConnectorMetadata, KVConnectorScheduler

if TYPE_CHECKING:
    from jaxllm.request import Request


class HostBlockStore:
    """An LRU of blocks' host K/V (each `[slots, block_size, kv_heads, head_dim]`), at most `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[BlockKey, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def put(self, keys: list[BlockKey], k: np.ndarray, v: np.ndarray) -> None:
        for i, key in enumerate(keys):
            self._blocks[key] = (k[:, i].copy(), v[:, i].copy())
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def take(self, keys: list[BlockKey]) -> tuple[np.ndarray, np.ndarray]:
        """The blocks' K and V stacked `[slots, len(keys), ...]` (each now most recently used)."""
        for key in keys:
            self._blocks.move_to_end(key)
        return (
            np.stack([self._blocks[key][0] for key in keys], axis=1),
            np.stack([self._blocks[key][1] for key in keys], axis=1),
        )


class OffloadingScheduler(KVConnectorScheduler):
    def __init__(self, *args, store: HostBlockStore):
        super().__init__(*args)
        self.store = store

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        first, last = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        return self.longest_hit(request, first, last, self.store.__contains__) * bs, False

    def update_state_after_alloc(self, request: Request, tables: BlockTables, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size  # the device cache's hits come first
        needed = self.needed_blocks(first, request.num_computed_tokens + num_external_tokens)
        hashes = self.kv.block_hashes(request, first + num_external_tokens // self.block_size)
        k, v = self.store.take([(group, hashes[i]) for group, i in needed])
        self._loads.append(HostLoad([tables[group][i] for group, i in needed], k, v))

    def build_connector_meta(self, evicted: list[tuple[int, BlockKey]]) -> KVConnectorMetadata:
        return super().build_connector_meta([(b, h) for b, h in evicted if h not in self.store])

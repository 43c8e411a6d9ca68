"""The KV connector interface, in vLLM's two halves (`KVConnectorBase_V1`).

With the hybrid KV cache manager a request has a block table per KV cache group, and a block holds its group's
layers: blocks are keyed by (group, hash), and a connector moves, per group, only the blocks a resume needs (all of a
full-attention group's, the window's of a windowed one: `needed_blocks`), which are the blocks a group still holds.

The **scheduler half** (pure Python, no JAX) decides: how many of a new request's tokens can be loaded from
outside and whether the load is asynchronous (`get_num_new_matched_tokens`); what to load once blocks are
allocated (`update_state_after_alloc`); each step's instructions for the runner half (`build_connector_meta`);
and, when a request finishes, whether its blocks must wait for a transfer (`request_finished`).

The **runner half** moves K/V between the device cache and elsewhere, through `runner/kv_blocks.py`'s compiled
gather and scatter: `start_load_kv` before the step's forward (loads into given blocks; evicted blocks are
copied out first, while they still hold their K/V), `save_kv` after it (blocks the step completed, and
finished requests' blocks), `get_finished` (requests whose asynchronous load or send has ended, each once, in
exactly one terminal state: done or failed with a reason).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxllm.config import KVTransferConfig
from jaxllm.engine.block_hash import BlockHash, BlockKey
from jaxllm.kv_transfer.scope import KVScope
from jaxllm.kv_transfer.stats import KVTransferStats

if TYPE_CHECKING:
    import numpy as np

    from jaxllm.engine.kv_cache_manager import KVCacheManager
    from jaxllm.request import Request
    from jaxllm.runner.kv_blocks import KVBlockMover

# a sink for blocks copied out of the device: their keys and host K/V, each [slots, n, block, heads, dim]
BlockSink = Callable[[list[BlockKey], "np.ndarray", "np.ndarray"], None]
BlockTables = Sequence[list[int]]  # a request's block table per KV cache group


@dataclass
class HostLoad:
    """Host K/V to scatter into `block_ids` (of any groups) before the step (each [slots, len(block_ids), ...])."""

    block_ids: list[int]
    k: Any
    v: Any


@dataclass
class KVConnectorMetadata:
    """One step's instructions from the scheduler half to the runner half."""

    evicted: list[tuple[int, BlockKey]] = field(default_factory=list)  # copy out before anything overwrites them
    loads: list[HostLoad] = field(default_factory=list)  # synchronous loads, before the forward
    remote_loads: list[Any] = field(default_factory=list)  # asynchronous loads to start (connector-specific)
    saves: list[tuple[list[int], list[BlockKey]]] = field(default_factory=list)  # (blocks, keys) after the step
    sends: list[Any] = field(default_factory=list)  # finished requests' blocks to offer (connector-specific)


@dataclass
class FinishedTransfers:
    """What the runner half reports since the last call: each request once."""

    received: list[str] = field(default_factory=list)  # asynchronous loads done: the request may run
    failed: dict[str, str] = field(default_factory=dict)  # request id → why its load failed
    sent: list[str] = field(default_factory=list)  # blocks held for a send that may now be freed


class KVConnectorScheduler:
    def __init__(self, config: KVTransferConfig, scope: KVScope, kv: KVCacheManager, stats: KVTransferStats):
        self.config, self.scope, self.kv, self.stats = config, scope, kv, stats
        self.block_size = kv.block_size
        self._loads: list[HostLoad] = []
        self._remote_loads: list[Any] = []
        self._saves: list[tuple[list[int], list[BlockKey]]] = []
        self._sends: list[Any] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the `num_computed_tokens` the device cache has that can be loaded, and whether
        asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS). At least one token is always left
        to compute (its logits give the next token)."""
        raise NotImplementedError

    def update_state_after_alloc(self, request: Request, tables: BlockTables, num_external_tokens: int) -> None:
        """The request's blocks are allocated: plan loading its `num_external_tokens` external tokens, which
        follow its `num_computed_tokens` (the device cache's hits; a multiple of the block size)."""
        raise NotImplementedError

    def needed_blocks(self, first_block: int, resume_at: int) -> list[tuple[int, int]]:
        """(group, block index) of each block from `first_block` on that a request resuming at token `resume_at`
        reads: up to the block holding token `resume_at - 1`, all of a full-attention group's, a windowed group's
        from the window of token `resume_at` (the others are the scratch block in its table: nothing to load)."""
        end = -(-resume_at // self.block_size)
        return [
            (group, i)
            for group in range(len(self.kv.windows))
            for i in range(max(first_block, self.kv.first_needed(group, resume_at)), end)
        ]

    def longest_hit(self, request: Request, first_block: int, last_block: int, present: Callable[[BlockKey], bool]):
        """The most whole blocks n <= last_block - first_block after the device cache's `first_block` such that
        every block a resume at block first_block + n needs is `present` (a longer hit can need fewer of a
        windowed group's early blocks, so each length is tried, longest first)."""
        hashes = self.kv.block_hashes(request, last_block)
        n = last_block - first_block
        for group, window in enumerate(self.kv.windows):  # a full group's blocks must all be there, from the first
            if window is None:
                missing = (i for i in range(first_block, first_block + n) if not present((group, hashes[i])))
                n = next(missing, first_block + n) - first_block
        while n > 0 and not all(
            present((g, hashes[i])) for g, i in self.needed_blocks(first_block, (first_block + n) * self.block_size)
        ):
            n -= 1
        return n

    def build_connector_meta(self, evicted: list[tuple[int, BlockKey]]) -> KVConnectorMetadata:
        """This step's instructions: the plans made since the last step."""
        meta = self._take_meta()
        meta.evicted = evicted
        return meta

    def _take_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata([], self._loads, self._remote_loads, self._saves, self._sends)
        self._loads, self._remote_loads, self._saves, self._sends = [], [], [], []
        return meta

    def check_request(self, kv_transfer_params: dict) -> None:
        """Raise ValueError when a new request's kv_transfer_params cannot work here (checked as it arrives)."""

    def request_computed(self, request: Request, tables: BlockTables, hashes: list[BlockHash]) -> None:
        """The request's first `len(hashes)` blocks now hold computed, verified K/V (never drafts): a producer
        may save those it has not saved yet (of each group, those its table still holds)."""

    def request_finished(self, request: Request, tables: BlockTables) -> tuple[bool, dict | None]:
        """A request finished (any reason; its status says which). Returns (hold its blocks until the runner half
        reports it `sent`, the kv_transfer_params for its output). A request whose asynchronous load is running
        has its blocks held by the scheduler until the load ends, whatever this returns."""
        return False, None


class KVConnectorWorker:
    """The runner half. `mover` copies blocks between the device cache and host or device arrays."""

    def __init__(self, mover: KVBlockMover, stats: KVTransferStats):
        self.mover, self.stats = mover, stats

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Before the step's forward: copy out evicted blocks, then scatter the synchronous loads."""
        for load in meta.loads:
            started = time.perf_counter()
            self.mover.scatter(load.block_ids, load.k, load.v)
            self.stats.observe_transfer("load", self.mover.nbytes(len(load.block_ids)), time.perf_counter() - started)

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """After the step: save what the step completed, offer what finished."""

    def get_finished(self) -> FinishedTransfers:
        return FinishedTransfers()

    def flush(self) -> None:
        """Wait until every save started so far is complete (a reader elsewhere may then find it)."""

    def close(self) -> None:
        """Stop background work (at engine shutdown)."""


class HostCopyWorker(KVConnectorWorker):
    """The runner half of connectors that keep blocks on the host or on disk: loads come as host arrays; blocks
    evicted from the device cache (before the step) and blocks the step completed (after it) go to `sink`."""

    def __init__(self, mover: KVBlockMover, stats: KVTransferStats, sink: BlockSink):
        super().__init__(mover, stats)
        self.sink = sink

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if meta.evicted:  # first: a load may go into a block just evicted
            self._copy_out([b for b, _ in meta.evicted], [h for _, h in meta.evicted])
        super().start_load_kv(meta)

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        for block_ids, keys in meta.saves:
            self._copy_out(block_ids, keys)

    def _copy_out(self, block_ids: list[int], keys: list[BlockKey]) -> None:
        started = time.perf_counter()
        k, v = self.mover.gather(block_ids)
        self.sink(keys, k, v)
        self.stats.observe_transfer("save", k.nbytes + v.nbytes, time.perf_counter() - started)

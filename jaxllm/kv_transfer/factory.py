"""Builds a KV connector's two halves from `kv_transfer_config`, and checks its settings at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxllm.config import KVTransferConfig
from jaxllm.kv_transfer.base import HostCopyWorker, KVConnectorScheduler, KVConnectorWorker
from jaxllm.kv_transfer.offloading import HostBlockStore, OffloadingScheduler
from jaxllm.kv_transfer.scope import KVScope
from jaxllm.kv_transfer.stats import KVTransferStats
from jaxllm.kv_transfer.storage import BlockFiles, SharedStorageScheduler, SharedStorageWorker
from jaxllm.kv_transfer.transfer import TransferScheduler, TransferWorker

if TYPE_CHECKING:
    from jaxllm.engine.kv_cache_manager import KVCacheManager
    from jaxllm.runner.kv_blocks import KVBlockMover


@dataclass
class KVConnector:
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
    stats: KVTransferStats


def make_kv_connector(config: KVTransferConfig, scope: KVScope, kv: KVCacheManager, mover: KVBlockMover) -> KVConnector:
    stats = KVTransferStats()
    scheduler, worker = BUILDERS[config.kv_connector](config, scope, kv, stats, mover)
    return KVConnector(scheduler, worker, stats)


Halves = tuple[KVConnectorScheduler, KVConnectorWorker]


def _offloading(config, scope, kv, stats: KVTransferStats, mover: KVBlockMover) -> Halves:
    store = HostBlockStore(_num_cpu_blocks(config, mover.nbytes(1)))
    return OffloadingScheduler(config, scope, kv, stats, store=store), HostCopyWorker(mover, stats, store.put)


def _shared_storage(config, scope, kv, stats: KVTransferStats, mover: KVBlockMover) -> Halves:
    files = BlockFiles(_storage_path(config), scope.key, scope.digest)
    block_shape = tuple(d for i, d in enumerate(mover.block_shape(1)) if i != 1)
    scheduler = SharedStorageScheduler(
        config, scope, kv, stats, files=files, block_shape=block_shape, dtype=mover.dtype
    )
    return scheduler, SharedStorageWorker(mover, stats, files)


def _transfer(config, scope, kv, stats: KVTransferStats, mover: KVBlockMover) -> Halves:
    worker = TransferWorker(mover, stats, host=config.extra("transfer_host", "127.0.0.1"))
    return TransferScheduler(config, scope, kv, stats, address=worker.address, bucket=mover.bucket), worker


# one builder per connector the config knows (config/kv_transfer.py's CONNECTORS: what each takes)
BUILDERS = {
    "OffloadingConnector": _offloading,
    "SharedStorageConnector": _shared_storage,
    "TransferConnector": _transfer,
}


def check_kv_connector(config: KVTransferConfig, bytes_per_block: int) -> None:
    """The settings that can be checked before the model loads (`bytes_per_block`: K and V of one block, all
    layers and devices), so that an impossible one fails in a second, not after the whole start."""
    if config.kv_connector == "OffloadingConnector":
        _num_cpu_blocks(config, bytes_per_block)
    elif config.kv_connector == "SharedStorageConnector":
        _storage_path(config)


def _storage_path(config: KVTransferConfig) -> str:
    path = config.extra("shared_storage_path")
    if not isinstance(path, str) or not path:
        raise ValueError('kv_transfer_config: SharedStorageConnector needs {"shared_storage_path": DIR}')
    return path


def _num_cpu_blocks(config: KVTransferConfig, bytes_per_block: int) -> int:
    """Host blocks for offloading: `num_cpu_blocks`, or `kv_offloading_size` GiB; never more than the RAM has."""
    blocks, size = config.extra("num_cpu_blocks"), config.extra("kv_offloading_size")
    if blocks is None and size is None:
        raise ValueError(
            'OffloadingConnector needs --kv-offloading-size GiB or {"num_cpu_blocks": N} in kv_connector_extra_config'
        )
    if blocks is None:
        blocks = int(float(size) * (1 << 30) // bytes_per_block)
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
        raise ValueError(f"OffloadingConnector: num_cpu_blocks must be a positive integer, got {blocks!r}")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if blocks * bytes_per_block > total:
        raise ValueError(
            f"OffloadingConnector: {blocks} host blocks of {bytes_per_block} bytes "
            f"({blocks * bytes_per_block / (1 << 30):.1f} GiB) are more than this machine's "
            f"{total / (1 << 30):.1f} GiB of memory"
        )
    return blocks

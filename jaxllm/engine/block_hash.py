"""Content hashes of KV blocks: the same in every process, so another engine or a file can share them.

A block's hash is sha256 over its parent block's hash and its token ids (vLLM's `--prefix-caching-hash-algo
sha256`); the first block's parent is the root, a digest of what makes KV compatible (model, dtype,
kv_cache_dtype, block size, tensor-parallel layout: `kv_transfer/scope.py`), so a key can only match KV
that the reader can use. Python's `hash()` would not do: it is salted per process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
BlockKey = tuple[int, BlockHash]  # (KV cache group, hash): a block's K/V is its group's layers' (kv_cache_groups.py)

NO_SCOPE: BlockHash = hashlib.sha256(b"jaxllm").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a block of `token_ids` following the block hashed `parent` (the root for the first)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def root_hash(scope: str) -> BlockHash:
    """The first block's parent for KV described by `scope` (a canonical string)."""
    return hashlib.sha256(b"jaxllm:" + scope.encode()).digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash) -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids` from `root`, as the KV manager names them (a router
    computes them to match a prompt against instances' KV events)."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def scoped_root(root: BlockHash, scope: bytes) -> BlockHash:
    """`root` narrowed to KV computed under `scope` too (a LoRA adapter's identity: lora/manager.py)."""
    return hashlib.sha256(root + b"scope:" + scope).digest()

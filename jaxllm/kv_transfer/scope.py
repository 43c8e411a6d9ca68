"""What makes two engines' KV interchangeable, and the check both ends of a transfer make.

KV computed by one engine is only usable by another with the same model weights (name and quantization),
compute dtype, cache dtype, block size and layer/head layout, KV cache groups, sharded over the same number of
devices. The
scope is the root of every block hash (engine/block_hash.py), so keys from different scopes never match;
a producer also sends its scope with the transfer parameters and the consumer refuses a mismatch by name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from jaxllm.engine.block_hash import BlockHash, root_hash


class KVScopeMismatch(ValueError):
    """The other end's KV is laid out differently; the message names each difference."""


@dataclass(frozen=True)
class KVScope:
    model: str
    quantization: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int
    kv_cache_groups: str  # which layers share a block, and each group's window (KVCacheGroups.key)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def key(self) -> str:
        """A canonical string: the same scope gives the same string in every process."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def root(self) -> BlockHash:
        return root_hash(self.key)

    @property
    def digest(self) -> str:
        """A short hex name (a storage folder's)."""
        return self.root.hex()[:16]

    def check(self, other: dict | None, peer: str) -> None:
        """Raise KVScopeMismatch naming each field in which `other` (the peer's scope) differs from ours."""
        if not isinstance(other, dict):
            raise KVScopeMismatch(f"{peer} sent no KV scope: cannot tell whether its KV fits this engine")
        ours = self.to_dict()
        diffs = [f"{k}: ours {ours[k]!r}, theirs {other.get(k)!r}" for k in ours if other.get(k) != ours[k]]
        if diffs:
            raise KVScopeMismatch(f"{peer}'s KV does not fit this engine ({'; '.join(diffs)})")

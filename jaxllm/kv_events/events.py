"""The KV events and their wire form, vLLM's names: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.

A `BlockStored` names a run of consecutive full blocks that one KV cache group just cached: their chained hashes
(engine/block_hash.py), the hash of the block before the first (None: the first follows the scope's root), their
token ids, the block size, the LoRA adapter (vLLM's `lora_id`), the KV scope (the hex root every hash chains from:
kv_transfer/scope.py) and the KV cache group (hybrid attention). A reader matches blocks only within one
(scope, lora_id, group), so KV that cannot be shared is never matched. Events travel in an `EventBatch` with a
sequence number (one batch per engine step), so a reader can tell when it missed one.

The wire form is msgpack of plain lists (a tag first), compact and language-neutral.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    scope: str = ""  # the KV scope's root, hex: what every hash chains from
    group: int = 0  # the KV cache group whose K/V the blocks hold


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    lora_id: int | None = None
    scope: str = ""
    group: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    seq: int  # 0, 1, 2, ... per publisher: a jump is a batch missed
    ts: float = field(default_factory=time.time)
    events: list[KVEvent] = field(default_factory=list)
    epoch: str = ""  # the publisher's start (random): new numbers from a restarted engine are told from repeats

    def encode(self) -> bytes:
        return msgpack.packb([self.ts, [_encode(e) for e in self.events], self.epoch], use_bin_type=True)

    @classmethod
    def decode(cls, seq: int, payload: bytes) -> EventBatch:
        ts, events, *rest = msgpack.unpackb(payload, raw=False)
        return cls(seq, ts, [_decode(e) for e in events], rest[0] if rest else "")


def _encode(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        e = event
        return [
            "BlockStored",
            e.block_hashes,
            e.parent_block_hash,
            e.token_ids,
            e.block_size,
            e.lora_id,
            e.scope,
            e.group,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.lora_id, event.scope, event.group]
    return ["AllBlocksCleared"]


def _decode(item: list) -> KVEvent:
    tag, *fields = item
    if tag == "BlockStored":
        hashes, parent, tokens, block_size, lora_id, scope, group = fields
        return BlockStored(list(hashes), parent, list(tokens), block_size, lora_id, scope, group)
    if tag == "BlockRemoved":
        hashes, lora_id, scope, group = fields
        return BlockRemoved(list(hashes), lora_id, scope, group)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {tag!r}")

"""Block hash → the instances holding it, fed by KV events; the longest cached prefix of a request per instance.

Keys are (scope, lora_id, group, hash): blocks of different KV scopes, adapters or KV cache groups never match. A
match walks the request's hashes once, intersecting the set of instances still matching (O(len(hashes)) dict
lookups, each set no larger than the instances holding the first block), so the cost does not grow with the
number of instances that hold nothing of it. Thread-safe: subscribers write from their thread, routers read.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from jaxllm.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

Key = tuple[str, int | None, int, bytes]


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[Key, set[str]] = {}
        self._held: dict[str, set[Key]] = {}
        self._lock = threading.Lock()

    def apply(self, instance: str, batch: EventBatch) -> None:
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        self._add(instance, (event.scope, event.lora_id, event.group, h))
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        self._discard(instance, (event.scope, event.lora_id, event.group, h))
                elif isinstance(event, AllBlocksCleared):
                    self._forget(instance)

    def forget(self, instance: str) -> None:
        """Every block of `instance` counts as not held (a resync, an instance gone)."""
        with self._lock:
            self._forget(instance)

    def blocks_of(self, instance: str) -> set[Key]:
        with self._lock:
            return set(self._held.get(instance, ()))

    def match(
        self, hashes: Sequence[bytes], *, scope: str, lora_id: int | None = None, group: int = 0
    ) -> dict[str, int]:
        """Instance → how many leading blocks of `hashes` it holds (only instances holding at least one)."""
        if not hashes:
            return {}
        with self._lock:
            first = self._holders.get((scope, lora_id, group, hashes[0]))
            if not first:
                return {}
            alive, found = set(first), {}
            for i in range(1, len(hashes)):
                holders = self._holders.get((scope, lora_id, group, hashes[i]), set())
                kept = alive & holders
                for gone in alive - kept:
                    found[gone] = i
                alive = kept
                if not alive:
                    return found
            for instance in alive:
                found[instance] = len(hashes)
            return found

    def _add(self, instance: str, key: Key) -> None:
        self._holders.setdefault(key, set()).add(instance)
        self._held.setdefault(instance, set()).add(key)

    def _discard(self, instance: str, key: Key) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(instance)
            if not holders:
                del self._holders[key]
        self._held.get(instance, set()).discard(key)

    def _forget(self, instance: str) -> None:
        for key in self._held.pop(instance, set()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(instance)
                if not holders:
                    del self._holders[key]


class InstanceView:
    """One instance's blocks as an event handler (subscriber.py): batches go into the shared index; a resync
    forgets them."""

    def __init__(self, index: PrefixIndex, instance: str):
        self.index = index
        self.instance = instance

    def apply(self, batch: EventBatch) -> None:
        self.index.apply(self.instance, batch)

    def resync(self) -> None:
        self.index.forget(self.instance)

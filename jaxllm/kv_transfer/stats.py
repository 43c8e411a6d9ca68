"""Running totals of a KV connector's work, read by `EngineCore.stats()` and exported on /metrics.

vLLM's names: `external_prefix_cache_queries` / `_hits` count tokens looked up outside the device cache and
found there. Transfers count bytes, seconds and failures per direction: `load` (host or storage into the device
cache), `save` (device cache out to host or storage), `send` (offered to a consumer), `receive` (pulled from a
producer). Each transfer's seconds are kept until a `totals()` call hands them (once) to a histogram.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

DIRECTIONS = ("load", "save", "send", "receive")


@dataclass
class KVTransferStats:
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    bytes: Counter = field(default_factory=Counter)  # direction → bytes
    transfers: Counter = field(default_factory=Counter)  # direction → count
    failures: Counter = field(default_factory=Counter)  # reason → count
    _latencies: list[tuple[str, float]] = field(default_factory=list)

    def observe_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.bytes[direction] += nbytes
        self.transfers[direction] += 1
        if len(self._latencies) < 100_000:  # nobody reading them: keep memory bounded
            self._latencies.append((direction, seconds))

    def observe_failure(self, reason: str) -> None:
        self.failures[reason] += 1

    def take_latencies(self) -> dict[str, list[float]]:
        """Each transfer's seconds since the last call, by direction (for a histogram: each is handed out once)."""
        latencies, self._latencies = self._latencies, []
        out: dict[str, list[float]] = {}
        for direction, seconds in latencies:
            out.setdefault(direction, []).append(seconds)
        return out

    def totals(self) -> dict:
        """Flat running totals, for `EngineCore.stats()`."""
        out: dict[str, Any] = {
            "external_prefix_cache_queries": self.external_prefix_cache_queries,
            "external_prefix_cache_hits": self.external_prefix_cache_hits,
        }
        for d in DIRECTIONS:
            out[f"kv_transfer_{d}_bytes"] = self.bytes[d]
            out[f"kv_transfer_{d}_count"] = self.transfers[d]
        out["kv_transfer_failures"] = dict(self.failures)
        out["kv_transfer_seconds"] = self.take_latencies()
        return out

"""`kv_events_config`: vLLM's `--kv-events-config` JSON, validated before anything loads.

`enable_kv_cache_events` turns them on; `publisher` is "zmq" (a PUB socket at `endpoint`, replays from
`replay_endpoint`) or "null" (in-process readers only); `buffer_steps` batches are kept for replay; `topic` prefixes
every message (kv_events/publisher.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from jaxllm.config.checks import json_object

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = "tcp://*:5558"
    buffer_steps: int = 10_000
    topic: str = ""

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config: enable_kv_cache_events must be true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config: publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}"
            )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(
                    f"kv_events_config: {name} must be a ZeroMQ address such as tcp://*:5557, got {value!r}"
                )
        if not isinstance(self.buffer_steps, int) or isinstance(self.buffer_steps, bool) or self.buffer_steps < 1:
            raise ValueError(f"kv_events_config: buffer_steps must be a positive integer, got {self.buffer_steps!r}")
        if not isinstance(self.topic, str):
            raise ValueError("kv_events_config: topic must be a string")

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """From a dict, a JSON string (`--kv-events-config`), or None."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = json_object("kv_events_config", value, (f.name for f in fields(cls)))
        return cls(**value)

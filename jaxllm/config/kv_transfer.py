"""`kv_transfer_config`: vLLM's name and JSON fields, validated before anything loads.

`kv_connector` names the connector (kv_transfer/factory.py builds it; `CONNECTORS` says what each takes),
`kv_role` what this engine does with KV (`kv_producer` saves or offers it, `kv_consumer` loads it, `kv_both`
does both), `kv_connector_extra_config` the connector's own settings, `kv_load_failure_policy` what a failed load
does to its request: `recompute` (compute from the first bad block, the default) or `fail` (finish it with an
error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxllm.config.checks import json_object

ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class ConnectorKind:
    roles: tuple[str, ...] = ROLES  # the kv_roles it takes
    records_evictions: bool = False  # the block manager reports the cached blocks it evicts (offloading)


CONNECTORS = {
    "OffloadingConnector": ConnectorKind(roles=("kv_both",), records_evictions=True),
    "SharedStorageConnector": ConnectorKind(),
    "TransferConnector": ConnectorKind(),
}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self):
        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"kv_transfer_config: unknown kv_connector {self.kv_connector!r}; known: {', '.join(CONNECTORS)}"
            )
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        roles = CONNECTORS[self.kv_connector].roles
        if self.kv_role not in roles:
            raise ValueError(
                f"kv_transfer_config: {self.kv_connector} takes kv_role {' or '.join(roles)}, not {self.kv_role!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be a JSON object")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config: kv_load_failure_policy must be one of {', '.join(FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )

    @property
    def records_evictions(self) -> bool:
        return CONNECTORS[self.kv_connector].records_evictions

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, name: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(name, default)

    @classmethod
    def parse(
        cls, value: KVTransferConfig | dict[str, Any] | str | None, kv_offloading_size: float | None = None
    ) -> KVTransferConfig | None:
        """From a dict, a JSON string (`--kv-transfer-config`), or None; `kv_offloading_size` (GiB, vLLM's
        `--kv-offloading-size`) alone means the OffloadingConnector with that much host memory."""
        if value is not None and not isinstance(value, KVTransferConfig):
            value = json_object("kv_transfer_config", value, cls.__dataclass_fields__)
        if kv_offloading_size is not None:
            if not isinstance(kv_offloading_size, int | float) or kv_offloading_size <= 0:
                raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {kv_offloading_size!r}")
            if value is None:
                value = {"kv_connector": "OffloadingConnector"}
            if isinstance(value, dict) and value.get("kv_connector") == "OffloadingConnector":
                extra = {**value.get("kv_connector_extra_config", {}), "kv_offloading_size": kv_offloading_size}
                value = {**value, "kv_connector_extra_config": extra}
            elif isinstance(value, dict | KVTransferConfig):
                raise ValueError("kv_offloading_size goes with the OffloadingConnector only")
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config needs 'kv_connector'")
        return cls(**value)

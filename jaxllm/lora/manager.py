"""Which adapters the engine knows, their weights read, and which device slot holds which (vLLM's LRU managers).

Host side, no JAX: the device write is the runner's `load_lora`, handed in. An adapter is read (and validated)
when first requested or loaded; its weights stay in host memory, least recently used dropped past `max_cpu_loras`
(read again from disk when next needed). After each schedule, `assign` gives every scheduled request its adapter's
slot, writing the adapter into a free slot, or into the least recently used one no running request needs (the
scheduler keeps at most `max_loras` adapters running, so there always is one).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from jaxllm.config import LoRAConfig
from jaxllm.lora.peft import load_peft_adapter
from jaxllm.lora.request import LoRARequest
from jaxllm.model.registry import ModelArch
from jaxllm.scheduler_output import SchedulerOutput


class LoRAManager:
    """Adapters are told apart by their scope (name and weights digest), so that one reloaded with new weights is a
    new adapter to the slots and the prefix cache while requests with the old one finish."""

    def __init__(
        self,
        config: LoRAConfig,
        arch: ModelArch,
        prepare: Callable[[dict[str, tuple[np.ndarray, np.ndarray]]], Any],
        write_slot: Callable[[int, Any], None],
    ):
        """`prepare`: an adapter's weights laid out as a device slot takes them (kept so: a slot write only moves
        them); `write_slot(slot, prepared)`: the device write (the runner's)."""
        self.config, self.arch, self.prepare, self.write_slot = config, arch, prepare, write_slot
        self.adapters: dict[int, LoRARequest] = {}  # known adapters, by lora_int_id
        self._scopes: dict[int, bytes] = {}  # each known adapter's scope
        self._weights: OrderedDict[bytes, Any] = OrderedDict()  # prepared, least recently used first
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # scope → device slot, least recently used first

    def add(self, request: LoRARequest) -> bytes:
        """Read and check the adapter (ValueError, FileNotFoundError) unless known; returns its scope. An id known
        under another name or path is refused: `lora_int_id` names one adapter."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                    f"unload it before reusing the id for {request.lora_name!r} ({request.lora_path})"
                )
            return self._scopes[request.lora_int_id]
        weights = load_peft_adapter(request.lora_path, self.arch, self.config.max_lora_rank)
        # (by name and weights, not by id: another engine, a P/D peer, may number the same adapter otherwise)
        scope = hashlib.sha256(f"lora:{request.lora_name}:{weights.digest}".encode()).digest()
        self._keep(scope, self.prepare(weights.projections))
        self.adapters[request.lora_int_id], self._scopes[request.lora_int_id] = request, scope
        return scope

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests still running with it keep their slot until they finish: `assign` never
        hands out a slot a running request needs). False: unknown."""
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self._weights.pop(self._scopes.pop(lora_int_id), None)
        return True

    def assign(self, out: SchedulerOutput, running: Iterable[bytes]) -> None:
        """Give each scheduled request its adapter's device slot, writing adapters into slots as needed. `running`:
        the scopes of the adapters running requests use."""
        needed = set(running)
        for scheduled in out.scheduled:
            request = scheduled.request
            if request.lora_request is not None:
                scheduled.lora_slot = self._slot(request.lora_request, request.lora_scope, needed)

    def _slot(self, lora: LoRARequest, scope: bytes, needed: set[bytes]) -> int:
        if scope in self._slots:
            self._slots.move_to_end(scope)
            return self._slots[scope]
        taken = set(self._slots.values())
        free = [s for s in range(1, self.config.num_slots) if s not in taken]
        if free:
            slot = free[0]
        else:  # the least recently used adapter no running request needs
            slot = self._slots.pop(next(v for v in self._slots if v not in needed))
        self.write_slot(slot, self._read(lora, scope))
        self._slots[scope] = slot
        return slot

    def _read(self, lora: LoRARequest, scope: bytes) -> Any:
        """The adapter prepared, from host memory, or read again from its files."""
        prepared = self._weights.get(scope)
        if prepared is None:
            prepared = self.prepare(load_peft_adapter(lora.lora_path, self.arch, self.config.max_lora_rank).projections)
        self._keep(scope, prepared)
        return prepared

    def _keep(self, scope: bytes, weights: Any) -> None:
        """Keep `weights` in host memory, the least recently used dropped past max_cpu_loras."""
        self._weights[scope] = weights
        self._weights.move_to_end(scope)
        while len(self._weights) > self.config.num_cpu_loras:
            self._weights.popitem(last=False)

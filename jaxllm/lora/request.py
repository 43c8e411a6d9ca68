"""`LoRARequest`: which adapter a request runs with, vLLM's names (`lora_name`, `lora_int_id`, `lora_path`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` (>= 1) identifies the adapter in the engine; `lora_path` is a PEFT checkpoint directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        lid = self.lora_int_id
        if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an integer >= 1, got {lid!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest: lora_path must be a non-empty string, got {self.lora_path!r}")

"""LoRA adapters (docs/lora.md): `request` (LoRARequest), `peft` (PEFT checkpoints in the fused layouts), `manager`
(adapters read, their device slots). The model's side is model/lora.py, the slots' arrays runner/lora_slots.py."""

from jaxllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]

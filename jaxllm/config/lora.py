"""`enable_lora` and its limits, vLLM's names and defaults: adapters in `max_loras` device slots at once, of rank at
most `max_lora_rank`, `max_cpu_loras` kept read in host memory, stored as `lora_dtype` (docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config.checks import positive

MAX_LORA_RANK = 512  # vLLM's largest
LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"  # vLLM's: the adapters' stored type; "auto": see `slot_dtype`

    def __post_init__(self):
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        positive("max_loras", self.max_loras)
        positive("max_lora_rank", self.max_lora_rank)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}")
        positive("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def slot_dtype(self, model_dtype: str, quantized_base: bool) -> str:
        """The adapters' type in their slots: `lora_dtype`, or under "auto" the model's type, as vLLM's, except on a
        quantized base: float16 there, whose rounding (2^-11) is far under the base's own, and whose half the
        bytes is what a decode step reads the adapter at (docs/lora.md, Measured)."""
        if self.lora_dtype != "auto":
            return self.lora_dtype
        return "float16" if quantized_base else model_dtype

    @property
    def num_slots(self) -> int:
        """Device slots: one per adapter, and slot 0, which holds zeros (a request without an adapter)."""
        return self.max_loras + 1

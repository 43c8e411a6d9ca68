"""The paged KV cache: block size, prefix caching, its memory budget and element type."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config.checks import one_of, positive
from jaxllm.config.model import DTYPES, resolve_dtype


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # explicit budget; else a share of device memory
    gpu_memory_utilization: float = 0.9
    cache_dtype: str = "auto"  # vLLM's kv_cache_dtype: "auto" (the model's dtype) or a float dtype
    # vLLM's: keep every layer's blocks (one block table) even when some layers attend only a sliding window
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self):
        if self.cache_dtype != "auto" and str(self.cache_dtype).lower() not in DTYPES:
            raise ValueError(f"kv_cache_dtype {self.cache_dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
        one_of("block_size", self.block_size, (8, 16, 32, 64, 128))
        positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    def kv_dtype(self, model_dtype):
        """The cache's element type: the model's for "auto"; bfloat16 halves the bytes attention reads."""
        return model_dtype if self.cache_dtype == "auto" else resolve_dtype(self.cache_dtype)

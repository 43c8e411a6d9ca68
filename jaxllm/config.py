"""Engine configuration: frozen, validated dataclasses, named as vLLM names them.

Each config checks itself on construction and raises a `ValueError` that names the field
and the limit, so bad settings fail before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.kv_transfer.config import KVTransferConfig
from jaxllm.spec_decode.config import SpeculativeConfig

DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
LOAD_FORMATS = ("auto", "hf", "safetensors", "gguf", "orbax", "dummy")
# weights/quant/plan.py says what each keeps quantized; None (vLLM's default) means "auto"
QUANTIZATIONS = ("auto", "int8", "int4", "none")


def check_quantization(quantization) -> str:
    """`quantization` by its one name ("auto" for vLLM's None), or a ValueError listing the choices."""
    if quantization is None:
        return "auto"
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of auto (the default: a GGUF keeps its Q8_0/Q4_0/Q4_1 blocks, other "
            f"formats load as float), int8, int4, none (dequantize everything to dtype); got {quantization!r}"
        )
    return quantization


def resolve_dtype(dtype):
    """ "auto" is float32 on CPU (fastest there) and bfloat16 on accelerators. Returns a jnp dtype."""
    import jax  # lazily: the scheduler imports this module and must stay free of JAX
    import jax.numpy as jnp

    if dtype == "auto" or dtype is None:
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(DTYPES)}")
        return jnp.dtype(DTYPES[dtype.lower()])
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype") from None
    if resolved.name not in DTYPES.values():
        raise ValueError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or float16")
    return resolved


def _positive(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own limit
    attention_backend: str = "auto"
    scan_layers: bool = True  # False: unrolled layers (faster CPU decode, compile grows with depth)
    quantization: str | None = "auto"  # "auto" (None too: a GGUF keeps its blocks), "int8", "int4", "none"

    def __post_init__(self):
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype.lower() not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of auto, {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _positive("max_model_len", self.max_model_len, allow_none=True)
        object.__setattr__(self, "quantization", check_quantization(self.quantization))  # one name for the default


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # explicit budget; else a share of device memory
    gpu_memory_utilization: float = 0.9
    cache_dtype: str = "auto"  # vLLM's kv_cache_dtype: "auto" (the model's dtype) or a float dtype

    def __post_init__(self):
        if self.cache_dtype != "auto" and str(self.cache_dtype).lower() not in DTYPES:
            raise ValueError(f"kv_cache_dtype {self.cache_dtype!r} is not supported; use auto, {', '.join(DTYPES)}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size!r}")
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    def kv_dtype(self, model_dtype):
        """The cache's element type: the model's for "auto"; bfloat16 halves the bytes attention reads."""
        return model_dtype if self.cache_dtype == "auto" else resolve_dtype(self.cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    policy: str = "fcfs"
    # vLLM's async_scheduling: schedule and launch step N+1 while step N runs on the device (docs/design.md)
    async_scheduling: bool = False
    # pipeline parallelism: batches in flight at once (one per stage), a request in at most one of them
    max_concurrent_batches: int = 1

    def __post_init__(self):
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("max_concurrent_batches", self.max_concurrent_batches)
        from jaxllm.engine.policy import resolve_policy  # lazily: policies import the request type

        resolve_policy(self.policy)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs a token per step"
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages, each its own devices and layers (parallel/pipeline.py)
    distributed_timeout: float = 60.0  # multi-host: seconds a node waits for another's arrays before giving up

    def __post_init__(self):
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_cache_dir: str | None = None  # None: jaxllm's cache folder; "" turns it off
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None

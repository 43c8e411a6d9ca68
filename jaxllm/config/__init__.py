"""Engine configuration: frozen dataclasses named as vLLM names them, one module per part, each checked on
construction with a `ValueError` naming the field and the limit (`checks.py`), so bad settings fail before any
weight is read. Feature packages (kv_transfer/, spec_decode/, ...) import their config from here, never the
other way: importing a config loads no model, kernel or connector code.
"""

from jaxllm.config.cache import CacheConfig
from jaxllm.config.engine import EngineConfig, check_combinations
from jaxllm.config.kv_events import KVEventsConfig
from jaxllm.config.kv_transfer import KVTransferConfig
from jaxllm.config.lora import LORA_DTYPES, LoRAConfig
from jaxllm.config.model import DTYPES, LOAD_FORMATS, QUANTIZATIONS, ModelConfig, check_quantization, resolve_dtype
from jaxllm.config.parallel import ParallelConfig
from jaxllm.config.pooler import POOLING_TYPES, RUNNERS, PoolerConfig
from jaxllm.config.scheduler import SchedulerConfig
from jaxllm.config.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

__all__ = [
    "DTYPES",
    "LOAD_FORMATS",
    "MAX_SPECULATIVE_TOKENS",
    "POOLING_TYPES",
    "QUANTIZATIONS",
    "RUNNERS",
    "CacheConfig",
    "EngineConfig",
    "KVEventsConfig",
    "KVTransferConfig",
    "LORA_DTYPES",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "PoolerConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "check_combinations",
    "check_quantization",
    "resolve_dtype",
]

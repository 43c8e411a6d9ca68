"""The whole engine's configuration, and the settings that cannot go together."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.config.cache import CacheConfig
from jaxllm.config.kv_transfer import KVTransferConfig
from jaxllm.config.lora import LoRAConfig
from jaxllm.config.model import ModelConfig
from jaxllm.config.parallel import ParallelConfig
from jaxllm.config.pooler import PoolerConfig, check_runner
from jaxllm.config.scheduler import SchedulerConfig
from jaxllm.config.speculative import SpeculativeConfig


def check_combinations(
    model: ModelConfig,
    parallel: ParallelConfig,
    async_scheduling: bool,
    speculative: SpeculativeConfig | None,
    kv_transfer: KVTransferConfig | None,
    lora: LoRAConfig | None = None,
    runner: str = "generate",
) -> None:
    """Refuse settings each valid alone that the engine does not run together (before a node joins the others or
    anything loads)."""
    if async_scheduling and parallel.nnodes > 1:  # followers wait for each step before the next broadcast
        raise ValueError(
            "async_scheduling is not supported with nnodes > 1: the multi-host step broadcast runs one step "
            "at a time (drop --async-scheduling, or run one node per data-parallel replica)"
        )
    if parallel.pipeline_parallel_size > 1:
        refused = {
            "async_scheduling (pipeline stages keep batches in flight already)": async_scheduling,
            "kv_transfer_config": kv_transfer is not None,
            "a draft model (speculative_config method draft_model)": speculative is not None
            and speculative.method == "draft_model",
            "scan_layers=False": not model.scan_layers,
        }
        for what, given in refused.items():
            if given:
                raise ValueError(f"pipeline_parallel_size > 1 is not supported with {what} yet")
    if lora is not None:
        refused = {
            "pipeline_parallel_size > 1": parallel.pipeline_parallel_size > 1,
            "nnodes > 1": parallel.nnodes > 1,
            "data_parallel_size > 1": parallel.data_parallel_size > 1,
            "scan_layers=False": not model.scan_layers,
            "a draft model (speculative_config method draft_model)": speculative is not None
            and speculative.method == "draft_model",
        }
        for what, given in refused.items():
            if given:
                raise ValueError(f"enable_lora is not supported with {what} yet")
    check_runner(runner)
    if runner == "pooling":  # prefill-only steps that return hidden states: nothing to draft, transfer or follow
        refused = {
            "speculative_config": speculative is not None,
            "async_scheduling": async_scheduling,
            "kv_transfer_config": kv_transfer is not None,
            "enable_lora": lora is not None,
            "pipeline_parallel_size > 1": parallel.pipeline_parallel_size > 1,
            "data_parallel_size > 1": parallel.data_parallel_size > 1,
            "nnodes > 1": parallel.nnodes > 1,
        }
        for what, given in refused.items():
            if given:
                raise ValueError(f"runner='pooling' (--runner pooling) is not supported with {what}")
    if kv_transfer is not None and parallel.nnodes > 1:
        raise ValueError(
            "kv_transfer_config is not supported with nnodes > 1 yet: a connector copies blocks of one process's "
            "cache (run one node per prefill or decode instance)"
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_cache_dir: str | None = None  # None: jaxllm's cache folder; "" turns it off
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA off
    reasoning_parser: str = "auto"  # "auto", "none" or a syntax's name (jaxllm/reasoning/syntax.py)
    runner: str = "generate"  # vLLM's: "generate" (tokens) or "pooling" (embeddings, scores: jaxllm/pooling/)
    pooler: PoolerConfig | None = None  # the pooling runner's, resolved against the model (pooling/config.py)

    def __post_init__(self):
        check_combinations(
            self.model,
            self.parallel,
            self.scheduler.async_scheduling,
            self.speculative,
            self.kv_transfer,
            self.lora,
            self.runner,
        )
        if self.runner == "pooling" and self.cache.enable_prefix_caching:
            raise ValueError("runner='pooling' needs enable_prefix_caching=False: MEAN and CLS pool every prompt token")

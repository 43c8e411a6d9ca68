"""EngineArgs: every engine setting in one flat dataclass, shared by `LLM(...)` and the CLI flags.

Field names are vLLM's; the CLI flag of a field is its name with dashes (`--max-num-seqs`).
`create_engine_config` turns them into the validated, frozen `EngineConfig` once the
model's own limits are known.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from jaxllm.config import (
    DTYPES,
    LOAD_FORMATS,
    LORA_DTYPES,
    QUANTIZATIONS,
    RUNNERS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_combinations,
)
from jaxllm.reasoning.syntax import SETTINGS as REASONING_SETTINGS

# defaults where vLLM's GPU-sized ones would make the CPU path compile too much
CPU_DEFAULTS = {"max_num_seqs": 64, "max_num_batched_tokens": 512}
ACCELERATOR_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}
HELP = {
    "reasoning_parser": "how a reasoning model's thinking is told from its answer: auto (the default: from the chat "
    "template, none when it does not think), qwen3, deepseek_r1, none; the server returns it as reasoning_content and "
    "starts a grammar after it",
    "quantization": "weights kept quantized: auto (the default: a GGUF keeps its Q8_0/Q4_0/Q4_1 blocks, other "
    "formats load as float), int8 (per output channel), int4 (groups of 32), none (dequantize everything to --dtype) "
    "(docs/quantization.md)",
    "speculative_config": 'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
    'or {"method": "draft_model", "model": ..., "num_speculative_tokens": 4} (docs/speculative_decoding.md)',
    "async_scheduling": "schedule and launch each step while the previous one runs on the device (vLLM's "
    "async scheduling; docs/design.md, One engine step)",
    "kv_transfer_config": 'a KV connector, vLLM\'s JSON: \'{"kv_connector": "TransferConnector", "kv_role": '
    '"kv_producer"}\', SharedStorageConnector with {"shared_storage_path": DIR}, OffloadingConnector '
    "(docs/disaggregated.md)",
    "pipeline_parallel_size": "pipeline stages: the layers split over this many groups of tensor-parallel devices, "
    "a batch in flight per stage (docs/scaling.md)",
    "disable_hybrid_kv_cache_manager": "keep every layer's KV blocks for the whole context, even for layers that "
    "attend only a sliding window (by default such layers free the blocks that leave their window: docs/models.md)",
    "kv_events_config": "KV events (what the prefix cache stores and drops, for cache-aware routers), vLLM's JSON: "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": '
    '"tcp://*:5558", "buffer_steps": 10000, "topic": ""}\'; publisher "null": in-process readers only '
    "(docs/scaling.md)",
    "data_parallel_policy": "how the front picks a data-parallel replica for each request: unset, vLLM's rule "
    "(fewest 4 x waiting + running); or a router policy: round_robin, least_loaded, session, prefix_aware (the "
    "replicas' KV events, in-process), or a dotted path to a jaxllm.routing.base.RoutingPolicy (docs/scaling.md)",
    "kv_offloading_size": "GiB of host memory for KV blocks evicted from the device cache (the OffloadingConnector)",
    "enable_lora": "serve LoRA adapters: LoRARequest in LLM.generate, --lora-modules in the server (docs/lora.md)",
    "max_loras": "LoRA adapters a step can mix (device slots; a request for a further one waits its turn)",
    "max_lora_rank": "the largest LoRA rank an adapter may have (an adapter of higher rank is refused at load)",
    "max_cpu_loras": "LoRA adapters kept read in host memory (default: max_loras)",
    "lora_dtype": "the LoRA adapters' stored type: auto (the model's dtype; float16 on a quantized base), float32, "
    "float16 or bfloat16",
    "runner": "generate (tokens) or pooling (embeddings and scores: /v1/embeddings, /score, /rerank; docs/serving.md)",
    "pooler_config": 'the pooling runner\'s pooler, vLLM\'s JSON: \'{"pooling_type": "MEAN", "normalize": true}\' '
    "(default: the model's sentence-transformers files, else LAST with L2 normalisation)",
}

# flags whose values are a closed set: argparse lists them in --help and refuses others before anything loads
CHOICES = {
    "reasoning_parser": REASONING_SETTINGS,
    "quantization": QUANTIZATIONS,
    "load_format": LOAD_FORMATS,
    "dtype": ("auto", *DTYPES),
    "kv_cache_dtype": ("auto", *DTYPES),
    "runner": RUNNERS,
    "lora_dtype": LORA_DTYPES,
}


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "bfloat16" halves KV memory and bytes read
    disable_hybrid_kv_cache_manager: bool = False  # vLLM's: sliding-window layers keep every block too
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # vLLM's: a mixture of experts' experts split whole over the TP devices
    pipeline_parallel_size: int = 1  # stages (docs/scaling.md): layers split over PP groups of TP devices
    data_parallel_size: int = 1
    data_parallel_policy: str | None = None  # a router policy picks each request's replica (None: vLLM's rule)
    nnodes: int = 1  # multi-host: every node runs the same command with its own node_rank
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    distributed_timeout: float = 60.0  # seconds a node waits for the others before exiting with an error
    load_format: str = "auto"
    quantization: str | None = "auto"  # "auto" (or None): a GGUF keeps its blocks; "int8", "int4"; "none": float
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = False  # vLLM's: prepare and launch step N+1 while step N runs on the device
    attention_backend: str = "auto"
    scan_layers: bool = True
    compilation_cache_dir: str | None = None
    speculative_config: dict | str | None = None  # vLLM's JSON: {"method": "ngram", "num_speculative_tokens": 4}
    kv_transfer_config: dict | str | None = None  # vLLM's JSON: {"kv_connector": ..., "kv_role": ...}
    kv_events_config: dict | str | None = None  # vLLM's JSON: {"enable_kv_cache_events": true, "publisher": "zmq"}
    kv_offloading_size: float | None = None  # GiB of host memory for evicted KV blocks (OffloadingConnector)
    enable_lora: bool = False  # vLLM's: serve LoRA adapters (docs/lora.md)
    max_loras: int = 1  # adapters in one step (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read in host memory (None: max_loras)
    lora_dtype: str = "auto"  # vLLM's: the adapters' stored type (auto: the model's; float16 on a quantized base)
    reasoning_parser: str = "auto"  # vLLM's: how thinking is told from the answer (docs/serving.md, Reasoning)
    runner: str = "generate"  # vLLM's: "pooling" serves embeddings and scores instead of tokens
    pooler_config: dict | str | None = None  # vLLM's JSON: {"pooling_type": "MEAN", "normalize": true}

    def pooler(self) -> PoolerConfig | None:
        return PoolerConfig.parse(self.pooler_config)

    def prefix_caching(self) -> bool:
        """Prefix caching, off for the pooling runner: MEAN and CLS pool every prompt token, which a cache hit
        would skip (vLLM keeps it only for LAST; jaxllm keeps one rule)."""
        return self.enable_prefix_caching and self.runner != "pooling"

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def kv_transfer(self) -> KVTransferConfig | None:
        return KVTransferConfig.parse(self.kv_transfer_config, self.kv_offloading_size)

    def kv_events(self) -> KVEventsConfig | None:
        return KVEventsConfig.parse(self.kv_events_config)

    def lora(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            self.model,
            self.tokenizer,
            self.dtype,
            self.load_format,
            self.seed,
            self.max_model_len,
            self.attention_backend,
            self.scan_layers,
            self.quantization,
        )

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            self.tensor_parallel_size,
            self.data_parallel_size,
            self.pipeline_parallel_size,
            self.nnodes,
            self.distributed_timeout,
            self.enable_expert_parallel,
        )

    def check(self) -> None:
        """Every setting that needs no model, alone and together: what can fail before a node joins the others
        or anything loads (the rest is checked against the model by `create_engine_config`)."""
        if self.reasoning_parser not in REASONING_SETTINGS:
            raise ValueError(
                f"reasoning_parser {self.reasoning_parser!r}: must be one of {', '.join(REASONING_SETTINGS)}"
            )
        if self.data_parallel_policy is not None:
            from jaxllm.routing.registry import load_policy

            load_policy(self.data_parallel_policy)  # a bad name or path fails here, in one line
        kv_events = self.kv_events()
        if kv_events is not None and kv_events.enable_kv_cache_events:
            if not self.enable_prefix_caching:
                raise ValueError("kv_events_config: KV events report the prefix cache; they need enable_prefix_caching")
            if kv_events.publisher == "zmq" and self.data_parallel_size > 1:
                raise ValueError(
                    "kv_events_config: the zmq publisher with data_parallel_size > 1 is not supported yet "
                    "(the replicas would bind one endpoint); run one instance per replica behind `jaxllm router`"
                )
        check_combinations(
            self.model_config(),
            self.parallel_config(),
            self.async_scheduling,
            self.speculative(),
            self.kv_transfer(),
            self.lora(),
            self.runner,
        )
        self.pooler()

    def create_engine_config(self, model_max_len: int, platform: str) -> EngineConfig:
        defaults = CPU_DEFAULTS if platform == "cpu" else ACCELERATOR_DEFAULTS
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of {model_max_len} tokens")
        max_num_seqs = self.max_num_seqs or defaults["max_num_seqs"]
        max_tokens = self.max_num_batched_tokens or max(defaults["max_num_batched_tokens"], max_num_seqs)
        return EngineConfig(
            model=self.model_config(),
            cache=CacheConfig(
                self.block_size,
                self.prefix_caching(),
                self.kv_cache_memory_bytes,
                self.gpu_memory_utilization,
                cache_dtype=self.kv_cache_dtype,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs,
                max_tokens,
                max_model_len,
                self.scheduling_policy,
                self.async_scheduling,
                max_concurrent_batches=self.pipeline_parallel_size,
            ),
            parallel=self.parallel_config(),
            compilation_cache_dir=self.compilation_cache_dir,
            speculative=self.speculative(),
            kv_transfer=self.kv_transfer(),
            lora=self.lora(),
            reasoning_parser=self.reasoning_parser,
            runner=self.runner,
            pooler=self.pooler(),
        )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=HELP.get(f.name)
                )
            else:
                # f.type is the annotation's text (from __future__ import annotations)
                kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(str(f.type), str)
                choices = CHOICES.get(f.name)
                metavar = "{" + ",".join(choices) + "}" if choices else f.name.upper()
                group.add_argument(
                    flag, type=kind, default=f.default, choices=choices, metavar=metavar, help=HELP.get(f.name)
                )
        parser.add_argument("--model", default=None, help="model path or HF repo (default: SmolLM2-135M-Instruct)")

    def to_cli_args(self) -> list[str]:
        """The command-line flags that give these arguments again (for a child `jaxllm serve`)."""
        flags = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                flags.append(flag if value else "--no-" + flag[2:])
            else:
                flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        return flags

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})

"""A simulation from engine settings and a cost model: the one API `jaxllm simulate` and `jaxllm tune` both call.

Settings left unset come from the engine the cost model was calibrated on (`CostModel.engine`). Pipeline
parallelism splits a one-stage cost model over the stages (jaxllm/sim/simulator.py); tensor parallelism is in the
cost model itself (`jaxllm calibrate --tensor-parallel-size N`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.config import SchedulerConfig, SpeculativeConfig
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.simulator import SimConfig, SimResult, cost_model_step_time, simulate, stage_layers
from jaxllm.sim.trace import TraceRequest


@dataclass(frozen=True)
class SimSettings:
    """The engine simulated, by vLLM's argument names; None: the calibrated engine's."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    scheduling_policy: str = "fcfs"
    num_blocks: int | None = None  # the KV pool as it is (`--num-gpu-blocks-override`)
    # else: the blocks one device's KV budget holds with every layer's K/V (None: the calibrated pool); a pipeline
    # stage keeps only its own layers' K/V, so with stages the pool grows to what the tightest stage holds
    budget_blocks: int | None = None
    pipeline_parallel_size: int = 1
    num_layers: int | None = None  # the model's layers (None: the cost model's record; without one, an even split)
    pp_layer_partition: str | None = None  # layers per stage, "15,15" (as JAXLLM_PP_LAYER_PARTITION)
    speculative_config: SpeculativeConfig | dict | str | None = None  # vLLM's JSON; n-gram only

    @classmethod
    def of(cls, args: Any, **others: Any) -> SimSettings:
        """The fields `args` names as EngineArgs and `jaxllm serve`'s flags do (either one), and `others`."""
        return cls(**{name: getattr(args, name) for name in ENGINE_ARGS}, **others)


# the fields named as in EngineArgs
ENGINE_ARGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "block_size",
    "enable_prefix_caching",
    "scheduling_policy",
    "pipeline_parallel_size",
    "speculative_config",
)


def sim_config(settings: SimSettings, cost: CostModel) -> SimConfig:
    """The simulator's config for `settings` on `cost`'s engine."""
    pp = settings.pipeline_parallel_size
    calibrated_pp = cost.engine.get("pipeline_parallel_size", 1)
    if calibrated_pp != 1:
        raise ValueError(
            f"the cost model was calibrated with pipeline_parallel_size={calibrated_pp}: its steps are whole "
            f"pipelines run one at a time; calibrate with one stage (the simulator splits it over the stages)"
        )
    if pp == 1 and settings.pp_layer_partition is not None:
        raise ValueError("--pp-layer-partition needs --pipeline-parallel-size > 1")
    layers = pipeline_layers(settings, cost) if pp > 1 else None
    scheduler = SchedulerConfig(
        _setting(settings.max_num_seqs, "max_num_seqs", cost),
        _setting(settings.max_num_batched_tokens, "max_num_batched_tokens", cost),
        _setting(settings.max_model_len, "max_model_len", cost),
        settings.scheduling_policy,
    )
    windows = tuple(cost.engine.get("kv_cache_groups") or (None,))
    num_blocks = settings.num_blocks
    if num_blocks is None:
        num_blocks = _setting(settings.budget_blocks, "num_blocks", cost)
        if pp > 1:
            num_blocks = pipeline_pool(num_blocks, layers or (1,) * pp)
    return SimConfig(
        scheduler,
        num_blocks=num_blocks,
        block_size=_setting(settings.block_size, "block_size", cost),
        enable_prefix_caching=_setting(settings.enable_prefix_caching, "enable_prefix_caching", cost),
        speculative=SpeculativeConfig.parse(settings.speculative_config),
        pipeline_parallel_size=pp,
        pp_stage_layers=layers,
        kv_cache_windows=windows,
    )


def _setting(value: Any, name: str, cost: CostModel) -> Any:
    """The value given, else the calibrated engine's."""
    if value is not None:
        return value
    if name not in cost.engine:
        raise ValueError(f"--{name.replace('_', '-')} is needed: the cost model does not record it")
    return cost.engine[name]


def pipeline_layers(settings: SimSettings, cost: CostModel) -> tuple[int, ...] | None:
    """Each stage's layers: `pp_layer_partition`, else the engine's split of `num_layers` (or the cost model's
    record of them); None when neither is known (an even split of the step time)."""
    pp, partition = settings.pipeline_parallel_size, settings.pp_layer_partition
    if partition is not None:
        try:
            counts = [int(n) for n in partition.split(",")]
        except ValueError:
            raise ValueError(f"--pp-layer-partition {partition!r}: not comma-separated counts") from None
        return stage_layers(sum(counts), pp, partition)
    num_layers = settings.num_layers if settings.num_layers is not None else cost.engine.get("num_layers")
    return stage_layers(num_layers, pp) if num_layers is not None else None


def pipeline_pool(num_blocks: int, layers: tuple[int, ...]) -> int:
    """The pool of a pipeline-parallel engine with the calibrated engine's KV bytes per device: a block's K/V on
    a stage is its layers' share of the whole model's, and the tightest stage sets the count (runner/pipeline.py)."""
    return num_blocks * sum(layers) // max(layers)


def simulate_priced(trace: list[TraceRequest], config: SimConfig, cost: CostModel, **options: Any) -> SimResult:
    """`simulate` priced by `cost`: its step times, and its per-request and wake-up costs; `options` are
    `simulate`'s keywords (seed, acceptance_rate, oracle_output_len, the pipeline's transfer costs)."""
    return simulate(trace, config, cost_model_step_time(cost, config), **cost.event_costs(), **options)

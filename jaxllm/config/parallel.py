"""How the model is split over devices and hosts."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config.checks import positive


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages, each its own devices and layers (parallel/pipeline.py)
    nnodes: int = 1  # hosts: every node runs the same command with its own node_rank
    distributed_timeout: float = 60.0  # multi-host: seconds a node waits for another's arrays before giving up
    enable_expert_parallel: bool = False  # a mixture of experts: whole experts per device (model/moe.py)

    def __post_init__(self):
        positive("tensor_parallel_size", self.tensor_parallel_size)
        positive("data_parallel_size", self.data_parallel_size)
        positive("pipeline_parallel_size", self.pipeline_parallel_size)
        positive("nnodes", self.nnodes)

"""The scheduler's limits: sequences and tokens per step, the context length, the waiting-queue policy."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config.checks import positive


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

    @property
    def max_steps_in_flight(self) -> int:
        """Steps launched and not yet applied at once (engine/step_loop.py): a batch per pipeline stage, one
        more with async scheduling."""
        return self.max_concurrent_batches + (1 if self.async_scheduling else 0)

    def __post_init__(self):
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("max_model_len", self.max_model_len)
        positive("max_concurrent_batches", self.max_concurrent_batches)
        from jaxllm.engine.policy import resolve_policy  # lazily: policies import the request type

        resolve_policy(self.policy)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs a token per step"
            )

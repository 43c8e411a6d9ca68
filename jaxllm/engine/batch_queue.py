"""Steps launched on the device and not yet applied on the host, oldest first. Pure Python.

JAX dispatch is asynchronous: a launched step's results are device arrays that exist before the
device has computed them. With async scheduling (`SchedulerConfig.async_scheduling`) EngineCore
launches step N+1 before it brings step N's results to the host, so up to two steps are in
the queue: the one being applied and the one just launched (`max_depth` 2; 1 without async).
Outputs are always applied in launch order: `Scheduler.update` of step N runs before that of N+1.

The scheduler keeps the matching per-request bookkeeping (`Scheduler._in_flight`): which requests
have a step in the queue, with how many tokens and placeholder output tokens, and decides who may
follow an unapplied step (`Scheduler._may_follow`). A pipeline-parallel engine (up to PP batches in
flight, a request never in two of them) is the same queue with `max_depth` PP and a follow rule
that says no to every request with a batch in flight.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from jaxllm.scheduler_output import SchedulerOutput


@dataclass
class InFlightStep:
    out: SchedulerOutput
    result: Any  # the runner's handle on the step's device results (opaque to the engine's host side)
    launched: float  # time.perf_counter() at launch


class BatchQueue:
    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be at least 1, got {max_depth}")
        self.max_depth = max_depth
        self._steps: deque[InFlightStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def full(self) -> bool:
        return len(self._steps) >= self.max_depth

    def push(self, step: InFlightStep) -> None:
        if self.full:
            raise RuntimeError(f"{self.max_depth} steps are in flight already: apply the oldest first")
        self._steps.append(step)

    def oldest(self) -> InFlightStep | None:
        return self._steps[0] if self._steps else None

    def newest(self) -> InFlightStep | None:
        return self._steps[-1] if self._steps else None

    def pop(self) -> InFlightStep:
        """The oldest step, the next whose outputs are applied."""
        return self._steps.popleft()

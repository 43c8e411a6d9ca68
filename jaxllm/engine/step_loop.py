"""The one step loop: schedule → launch → apply, with up to `max_in_flight` steps launched and not yet applied.

JAX dispatch is asynchronous: a launched step's results are device arrays that exist before the device has
computed them. Every engine layout is this loop with another depth (`SchedulerConfig.max_steps_in_flight`):

- one step at a time (depth 1): each step is applied right after its launch;
- async scheduling (depth 2): step N+1 is scheduled and launched while step N runs, then step N is applied;
- pipeline parallelism (depth PP): a batch per stage in flight, the oldest applied when the pipeline is full.

The scheduler keeps the per-request bookkeeping of what is in flight and decides who may follow an unapplied
step (engine/in_flight.py); outputs are always applied in launch order. When nothing new can be scheduled, the
oldest step in flight is applied (its requests may then go on). The simulator (sim/simulator.py) runs this
loop on its virtual clock, with launch and apply callbacks that price the step instead of running it. Pure
Python.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxllm.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from jaxllm.engine.scheduler import Scheduler


@dataclass
class InFlightStep:
    out: SchedulerOutput
    result: Any  # the launcher's handle on the step's results (opaque to the loop)
    launched: float  # time.perf_counter() at launch


# launch(out, newest step in flight) → (handle on its results, or None when nothing runs; outputs already due,
# e.g. of the requests a failed launch finished)
Launch = Callable[[SchedulerOutput, "InFlightStep | None"], "tuple[Any | None, list]"]
Apply = Callable[[InFlightStep], list]  # a launched step's results applied: the outputs they give


class StepLoop:
    def __init__(self, scheduler: Scheduler, launch: Launch, apply: Apply, max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.scheduler, self.launch, self.apply = scheduler, launch, apply
        self.max_in_flight = max_in_flight
        self.in_flight: deque[InFlightStep] = deque()  # oldest first

    def __len__(self) -> int:
        return len(self.in_flight)

    def step(self) -> tuple[SchedulerOutput, list]:
        """Schedule and launch one step (the launcher sees an empty one too: a KV connector's work rides on it),
        then apply the oldest step in flight if the queue is full, or if nothing new was launched."""
        out = self.scheduler.schedule()
        started = time.perf_counter()
        result, outputs = self.launch(out, self.in_flight[-1] if self.in_flight else None)
        if result is not None:
            self.in_flight.append(InFlightStep(out, result, started))
        if len(self.in_flight) >= self.max_in_flight or (result is None and self.in_flight):
            outputs = outputs + self.apply(self.in_flight.popleft())
        return out, outputs

    def drain(self) -> list:
        """Apply every launched step, scheduling nothing new."""
        outputs: list = []
        while self.in_flight:
            outputs += self.apply(self.in_flight.popleft())
        return outputs

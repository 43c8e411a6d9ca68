"""The device on the simulator's virtual clock: a launched batch goes through the pipeline stages.

Launching costs the host no time; applying waits for the batch's last stage. The stages are a pipeline: stage s
of a batch starts when stage s - 1 of it and stage s of the batch before it have finished, and takes the time
`PipelineCost` gives it (its layers' share of the step time the cost model prices for the batch's shape, plus
the hidden states' copy into it). With one stage it is the one-step-at-a-time device exactly (the whole step
time, nothing to copy). `summary` reports the bubble: the fraction of the stages' time idle while at least one
batch was in flight, (P x busy time - sum of stage times) / (P x busy time), with the idle periods between
requests left out; and the mean number of batches in flight over that busy time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxllm.scheduler_output import SchedulerOutput
from jaxllm.sim.costmodel import PipelineCost, bucket_tokens

StepTime = Callable[[SchedulerOutput], float]


@dataclass
class Batch:
    """A batch in flight (with one stage, the step being run)."""

    finish: float  # when its last stage ends
    elapsed: float  # from its launch to `finish`, as summed (the one-stage loop's step time exactly)


class VirtualDevice:
    def __init__(
        self, pipeline: PipelineCost, step_time: StepTime, max_num_batched_tokens: int, idle_wake_s: float, now: float
    ):
        self.pipeline, self.step_time = pipeline, step_time
        self.max_num_batched_tokens, self.idle_wake_s = max_num_batched_tokens, idle_wake_s
        self.idle = True  # the first step after the engine was idle takes `idle_wake_s` longer (its first stage)
        self.stage_free = [now] * pipeline.num_stages  # when each stage finishes the last batch given to it
        self.stage_busy = [0.0] * pipeline.num_stages
        self.busy_since, self.busy_time, self.batch_time = now, 0.0, 0.0  # time with a batch in flight; batches x time

    def launch(self, out: SchedulerOutput, now: float, first_in_flight: bool) -> Batch:
        """Put `out` through the stages, each after the batch before it there."""
        bucket = bucket_tokens(out.num_tokens, self.max_num_batched_tokens)
        durations = self.pipeline.stage_times(self.step_time(out), bucket)
        durations[0] += self.idle_wake_s if self.idle else 0.0
        self.idle = False
        if first_in_flight:
            self.busy_since = now
        elapsed = 0.0  # from the launch to the end of the stage so far
        for s, seconds in enumerate(durations):
            elapsed = max(elapsed, self.stage_free[s] - now) + seconds
            self.stage_free[s] = now + elapsed
            self.stage_busy[s] += seconds
        return Batch(now + elapsed, elapsed)

    def finish(self, batch: Batch, now: float, last_in_flight: bool) -> float:
        """Wait for the batch's last stage (the host waits only for the oldest: never later than its end);
        returns the clock then."""
        now = max(now, batch.finish)
        self.batch_time += batch.elapsed
        if last_in_flight:
            self.busy_time += now - self.busy_since
        return now

    def summary(self) -> dict:
        """The result JSON's pipeline figures (the module docstring): the bubble and batches in flight over the
        time at least one batch was in flight, each stage's busy fraction of it, and the model's parameters."""
        pipeline, busy = self.pipeline, self.busy_time
        return {
            "pipeline_parallel_size": pipeline.num_stages,
            "pp_stage_shares": list(pipeline.stage_shares),
            "pp_transfer_latency_s": pipeline.transfer_latency_s,
            "pp_transfer_s_per_token": pipeline.transfer_s_per_token,
            "pp_busy_s": busy,
            "pp_bubble_fraction": 1 - sum(self.stage_busy) / (pipeline.num_stages * busy) if busy else None,
            "pp_mean_batches_in_flight": self.batch_time / busy if busy else None,
            "pp_stage_utilization": [b / busy if busy else None for b in self.stage_busy],
        }

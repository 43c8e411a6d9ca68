"""A trace through a real `EngineCore`, in real time, with every step recorded.

Requests enter when the wall clock passes their arrival time (between steps, as a server's
engine loop takes them in), with output lengths forced as the simulator forces them. Each
step records when it started, what the scheduler put in it and which requests ran, so the
same run can be (1) replayed in the simulator with these very step times, to check that the
simulator takes the same decisions, (2) used to fit the engine's per-step host overhead in
`jaxllm calibrate`, and (3) compared with a simulation as an offline stand-in for a server run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from itertools import pairwise

from tqdm.auto import tqdm

from jaxllm.bench.results import RequestRecord
from jaxllm.sampling_params import SamplingParams
from jaxllm.sim.costmodel import StepShape
from jaxllm.sim.simulator import StepTime, record_token, recorded_step_time
from jaxllm.sim.trace import TraceRequest, prompt_token_ids


@dataclass
class EngineStep:
    start: float  # seconds since the run began
    end: float
    request_ids: list[str]
    shape: StepShape


@dataclass
class EngineRun:
    steps: list[EngineStep]
    records: list[RequestRecord]  # one per trace request, in trace order
    duration: float
    first_step: dict[str, int]  # request id → the first step it could run in (it had arrived)

    def durations(self) -> list[float]:
        """Each step's share of the run: start to the next step's start (the last: to its end)."""
        starts = [s.start for s in self.steps]
        return [b - a for a, b in pairwise(starts)] + [self.steps[-1].end - self.steps[-1].start]

    def replay(self, trace: list[TraceRequest]) -> tuple[list[TraceRequest], StepTime]:
        """The trace and a step-time function that make the simulator see this run's clock.

        Each request arrives at the start of the first step it could have joined (the engine admits
        requests only between steps), computed with the same float additions the simulator's clock
        makes, so arrivals and step boundaries coincide exactly.
        """
        durations = self.durations()
        clock = [self.steps[0].start]
        for d in durations:
            clock.append(clock[-1] + d)
        aligned = [replace(r, arrival_time=clock[self.first_step[str(i)]]) for i, r in enumerate(trace)]
        return aligned, recorded_step_time(durations)


def forced_params(output_len: int) -> SamplingParams:
    """Exactly `output_len` tokens, whatever the model samples (greedy: reproducible)."""
    return SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0.0)


def run_trace_on_engine(core, trace: list[TraceRequest], *, seed: int = 0, progress: str | None = None) -> EngineRun:
    """Replay `trace` (sorted by arrival) through `core` in real time; request ids are trace indices. `progress`:
    a bar of that name over the finished requests, on stderr.

    The run starts with an empty prefix cache, as a simulation does: traces made with one seed give
    request i the same first tokens, so a cache left by an earlier run would serve hits that the
    simulation cannot know of (calibration's light trace ran after its engine pass 20-50 ms faster
    than simulated, and the idle wake-up it fits came out as 0)."""
    if not core.reset_prefix_cache():
        raise ValueError("the engine has requests in flight: a trace run needs it to itself")
    captured = []
    schedule = core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        captured.append(out)
        return out

    records = [RequestRecord(prompt_len=0, start=r.arrival_time) for r in trace]
    received = [0] * len(trace)
    last_token = [0.0] * len(trace)
    first_step: dict[str, int] = {}
    steps: list[EngineStep] = []
    core.scheduler.schedule = recording_schedule
    bar = tqdm(total=len(trace), desc=progress, disable=progress is None, unit="req")
    shown = 0.0  # when the bar was last redrawn (run time)
    t0 = time.monotonic()
    try:
        next_arrival = 0
        while next_arrival < len(trace) or core.scheduler.num_unfinished:
            now = time.monotonic() - t0
            while next_arrival < len(trace) and trace[next_arrival].arrival_time <= now:
                r, rid = trace[next_arrival], str(next_arrival)
                tokens = prompt_token_ids(r, next_arrival, seed)
                records[next_arrival].prompt_len = len(tokens)
                core.add_request(
                    rid,
                    tokens,
                    forced_params(r.output_len),
                    priority=r.priority,
                    arrival_time=t0 + r.arrival_time,
                    user=r.user,
                )
                first_step[rid] = len(steps)
                next_arrival += 1
            if not core.scheduler.num_unfinished:
                time.sleep(max(trace[next_arrival].arrival_time - (time.monotonic() - t0), 0))
                continue
            start = time.monotonic() - t0
            outputs = core.step()
            end = time.monotonic() - t0
            out = captured[-1]
            if out.is_empty:
                continue
            steps.append(EngineStep(start, end, [s.request.request_id for s in out.scheduled], StepShape.of(out)))
            if progress is not None and end - shown > 0.5:  # redrawn as steps run, not only as requests finish
                bar.set_postfix_str(f"{len(steps)} steps")
                shown = end
            for output in outputs:
                i = int(output.request_id)
                record = records[i]
                new = len(output.outputs[0].token_ids) - received[i]  # several when drafts were accepted
                if new > 0:
                    record_token(record, end, last_token[i], new)
                    last_token[i] = end
                received[i] = len(output.outputs[0].token_ids)
                if output.finished:
                    record.latency = end - record.start
                    record.success = output.error is None
                    record.error = output.error
                    bar.update()
    finally:
        core.scheduler.schedule = schedule
        bar.close()
    duration = (steps[-1].end - trace[0].arrival_time) if steps else 0.0
    return EngineRun(steps, records, duration, first_step)

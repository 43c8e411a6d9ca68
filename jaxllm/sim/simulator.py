"""The trace-driven simulator: the engine's own `Scheduler` and `KVCacheManager` on a virtual clock.

No copy of the scheduling logic lives here. Each step, the real scheduler decides what runs; a
step-time function (a fitted `CostModel`, or recorded real step times) advances the clock; the
real `Scheduler.update` applies one dummy token per sampling request. Output lengths come from
the trace and are forced as a real replay forces them (min_tokens = max_tokens = output_len,
EOS ignored), so every scheduling decision — batching, chunked prefill, preemption, prefix-cache
hits — is the engine's. Requests arrive when the clock passes their arrival time, between steps,
as they reach a running engine — `request_latency_s` after they were sent, the serving
front-end's share (`CostModel.request_latency_s`); latencies count from the send. Nothing is
random: the result depends on the trace and the seed (which fixes made-up prompt tokens, hence
prefix-cache hits) only.

The loop is the engine's own (engine/step_loop.py), as deep as the pipeline has stages: the launch and apply
callbacks price the step on the virtual device (sim/virtual_device.py: stages, bubble) instead of running it.
Speculative decoding (`SimConfig.speculative`, n-gram): made-up drafts and an acceptance model
(sim/speculation.py); the real scheduler decides how many drafts it verifies (the load-aware cap, the token
budget, the rows of logits, max_tokens), the cost model prices that step's real shape, and the scheduler's
`DraftBudget` is fed each step's simulated time, as the engine feeds it measured ones.
Pipeline parallelism (`SimConfig.pipeline_parallel_size` P > 1): the scheduler is the engine's under PP
(`max_concurrent_batches` = P: each batch takes at most ceil(max_num_seqs / P) rows, a request is in one
batch in flight at most).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from jaxllm.bench.results import RequestRecord, summarize
from jaxllm.config import SchedulerConfig, SpeculativeConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.step_loop import InFlightStep, StepLoop
from jaxllm.kv_cache_groups import blocks_needed
from jaxllm.kv_events.publisher import KVEventCollector
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.scheduler_output import SchedulerOutput
from jaxllm.sim.costmodel import (
    DEFAULT_PP_TRANSFER_LATENCY_S,
    DEFAULT_PP_TRANSFER_S_PER_TOKEN,
    CostModel,
    PipelineCost,
    StepShape,
)
from jaxllm.sim.speculation import DUMMY_TOKEN, SimulatedSpeculation
from jaxllm.sim.trace import TraceRequest, prompt_token_ids
from jaxllm.sim.virtual_device import StepTime, VirtualDevice

MAX_SERIES_POINTS = 2000  # KV-usage samples kept in the JSON (evenly thinned)


@dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig
    num_blocks: int  # the KV pool, scratch block included (as `ModelRunner.num_blocks`)
    block_size: int = 16
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None  # n-gram speculation (see the module docstring)
    pipeline_parallel_size: int = 1  # stages; the scheduler config gets max_concurrent_batches = this
    pp_stage_layers: tuple[int, ...] | None = None  # layers of each stage (`stage_layers`); None: an even split
    # one per KV cache group (kv_cache_groups.py): its layers' sliding window, None for full attention; a block is
    # a slot of each group's layers, and windowed groups free what leaves the window, as the engine's manager does
    kv_cache_windows: tuple[int | None, ...] = (None,)

    def __post_init__(self):
        if self.speculative is not None and self.speculative.method != "ngram":
            raise ValueError(
                f"the simulator prices n-gram speculation only (drafts proposed on the host, free); method "
                f"{self.speculative.method!r} would need its draft model's steps in the cost model"
            )
        pp = self.pipeline_parallel_size
        if pp < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
        if self.pp_stage_layers is not None:
            layers = tuple(self.pp_stage_layers)
            if len(layers) != pp or min(layers) < 1:
                raise ValueError(f"pp_stage_layers must give each of the {pp} stages at least one layer, got {layers}")
            object.__setattr__(self, "pp_stage_layers", layers)
        batches = self.scheduler.max_concurrent_batches
        if batches not in (1, pp):
            raise ValueError(f"the scheduler's max_concurrent_batches={batches} is not pipeline_parallel_size={pp}")
        if batches != pp:  # as EngineArgs.create_engine_config sets it: a batch in flight per stage
            object.__setattr__(self, "scheduler", replace(self.scheduler, max_concurrent_batches=pp))

    def pipeline_cost(
        self,
        transfer_latency_s: float = DEFAULT_PP_TRANSFER_LATENCY_S,
        transfer_s_per_token: float = DEFAULT_PP_TRANSFER_S_PER_TOKEN,
    ) -> PipelineCost:
        """The stages' split of the step time: by `pp_stage_layers`, else evenly."""
        transfer = {"transfer_latency_s": transfer_latency_s, "transfer_s_per_token": transfer_s_per_token}
        if self.pp_stage_layers is not None:
            return PipelineCost.of_layers(self.pp_stage_layers, **transfer)
        return PipelineCost.of_layers([1] * self.pipeline_parallel_size, **transfer)


def stage_layers(num_layers: int, pipeline_parallel_size: int, partition: str | None = None) -> tuple[int, ...]:
    """Each stage's layer count as the engine splits them (`jaxllm.parallel.pipeline.layer_ranges`: vLLM's
    split, or `partition` / JAXLLM_PP_LAYER_PARTITION, "15,15"). Imports JAX (the engine's own function)."""
    from jaxllm.parallel.pipeline import layer_ranges

    return tuple(end - start for start, end in layer_ranges(num_layers, pipeline_parallel_size, partition))


def cost_model_step_time(cost: CostModel, config: SimConfig) -> StepTime:
    limit = config.scheduler.max_num_batched_tokens
    return lambda out: cost.step_time(StepShape.of(out), limit)


def recorded_step_time(durations: list[float]) -> StepTime:
    """Replay measured step durations in order (to check the simulator against a real run)."""
    it = iter(durations)

    def step_time(out):
        try:
            return next(it)
        except StopIteration:
            raise RuntimeError(f"the simulation ran more steps than the {len(durations)} recorded") from None

    return step_time


@dataclass
class SimResult:
    records: list[RequestRecord]  # one per trace request, in trace order
    duration: float  # makespan: first arrival to last token
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_usage: list[tuple[float, float]]  # (time, fraction of blocks in use) after each step
    free_blocks_at_end: int
    num_usable_blocks: int
    steps: list[list[str]] | None = None  # request ids scheduled in each step, when recorded
    extra: dict = field(default_factory=dict)
    draft_tokens: list[int] | None = None  # speculation: draft tokens each trace request verified
    accepted_tokens: list[int] | None = None  # ... and how many of them were accepted

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_json(self, **summary_kwargs) -> dict:
        """`jaxllm bench serve`'s result keys, plus the scheduler's view of the run."""
        result = summarize(self.records, self.duration, **summary_kwargs)
        series = self.kv_usage[:: max(1, -(-len(self.kv_usage) // MAX_SERIES_POINTS))]
        usage = [u for _, u in self.kv_usage] or [0.0]
        result.update(
            {
                "num_steps": self.num_steps,
                "num_preemptions": self.num_preemptions,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "mean_kv_cache_usage": sum(usage) / len(usage),
                "max_kv_cache_usage": max(usage),
                "kv_cache_usage": {"time_s": [t for t, _ in series], "usage": [u for _, u in series]},
                **self.extra,
            }
        )
        return result


def record_token(record: RequestRecord, now: float, previous: float, count: int = 1) -> None:
    """`count` more tokens at `now` (a verification step brings several); `previous` is when the request's
    last one came. As `jaxllm bench serve` records a stream chunk of several tokens: the first chunk's extra
    tokens 0 s apart, a later chunk's gap spread evenly over its tokens."""
    if record.ttft is None:
        record.ttft = now - record.start
        record.itl.extend([0.0] * (count - 1))
    else:
        record.itl.extend([(now - previous) / count] * count)
    record.output_len += count


def simulate(
    trace: list[TraceRequest],
    config: SimConfig,
    step_time: StepTime,
    *,
    seed: int = 0,
    oracle_output_len: bool = False,
    record_steps: bool = False,
    request_latency_s: float = 0.0,
    idle_wake_s: float = 0.0,
    acceptance_rate: float | None = None,
    pp_transfer_latency_s: float = DEFAULT_PP_TRANSFER_LATENCY_S,
    pp_transfer_s_per_token: float = DEFAULT_PP_TRANSFER_S_PER_TOKEN,
) -> SimResult:
    """Run `trace` (sorted by arrival) to completion; `oracle_output_len` tells policies each true output length.

    `request_latency_s` and `idle_wake_s` are `CostModel`'s (see there): a request reaches the scheduler
    that long after it was sent; the first step after the engine was idle takes that much longer (its
    first stage does, under PP).
    `acceptance_rate`: with `config.speculative`, the per-position acceptance rate of requests whose trace
    record has none (sim/speculation.py).
    `pp_transfer_latency_s`, `pp_transfer_s_per_token`: with `config.pipeline_parallel_size` > 1, the copy of
    a batch's hidden states across each stage boundary (`PipelineCost`); unused with one stage.
    """
    for name, value in (("request_latency_s", request_latency_s), ("idle_wake_s", idle_wake_s)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if acceptance_rate is not None and not 0 <= acceptance_rate <= 1:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
    if config.speculative is not None and acceptance_rate is None:
        missing = sum(1 for r in trace if r.acceptance_rate is None)
        if missing:
            raise ValueError(
                f"speculation needs an acceptance rate: {missing} trace request(s) carry none and no global "
                f"rate was given (--acceptance-rate)"
            )
    pipeline = config.pipeline_cost(pp_transfer_latency_s, pp_transfer_s_per_token)
    speculation = None
    if config.speculative is not None:
        speculation = SimulatedSpeculation(config.speculative, len(trace), acceptance_rate, seed)
    engine = SimEngine(trace, config, seed, oracle_output_len, request_latency_s, speculation, record_steps)
    limit = config.scheduler.max_num_batched_tokens
    engine.device = VirtualDevice(pipeline, step_time, limit, idle_wake_s, engine.clock)
    return engine.run()


class SimEngine:
    """One simulated engine: the trace's requests sent to it reach the real scheduler on the virtual clock; the
    engine's step loop launches each step on the virtual device and applies its made-up tokens with the real
    `Scheduler.update`. `run()` serves a whole trace; a cluster (sim/cluster.py) drives several with `send`,
    `next_step_time` and `step` on one clock. `records` is shared by index with the trace (a cluster's engines
    share one list, each filling the records of the requests it was sent)."""

    device: VirtualDevice

    def __init__(
        self,
        trace: list[TraceRequest],
        config: SimConfig,
        seed: int,
        oracle_output_len: bool,
        request_latency_s: float,
        speculation: SimulatedSpeculation | None,
        record_steps: bool,
        records: list[RequestRecord] | None = None,
    ):
        self.trace, self.config, self.seed = trace, config, seed
        self.oracle_output_len, self.request_latency_s = oracle_output_len, request_latency_s
        self.speculation = speculation
        windows = config.kv_cache_windows
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching, windows=windows)
        sched = config.scheduler
        needed = blocks_needed(windows, sched.max_model_len, config.block_size, sched.max_num_batched_tokens)
        if self.kv.num_usable_blocks < needed:
            raise ValueError(
                f"the KV pool holds {self.kv.num_usable_blocks} blocks, fewer than the {needed} one sequence of "
                f"max_model_len={sched.max_model_len} tokens needs: raise the number of blocks"
            )
        self.scheduler = Scheduler(config.scheduler, self.kv, config.speculative)
        depth = config.scheduler.max_concurrent_batches  # = the stages (SimConfig): a batch in flight per stage
        self.loop = StepLoop(self.scheduler, self._launch, self._apply, depth)
        if records is None:
            records = [RequestRecord(prompt_len=0, start=r.arrival_time) for r in trace]
        self.records = records
        self.pending: deque[tuple[int, list[int] | None]] = deque()  # sent, not yet at the scheduler
        self.kv_events: KVEventCollector | None = None  # KV events (kv_events/), flushed after each step
        self.num_done = 0  # requests finished or refused
        self.done: list[int] | None = None  # a list: each request finished or refused is appended (sim/pd.py)
        self.index: dict[int, int] = {}  # id(Request) → trace index
        self.last_token = [0.0] * len(trace)
        self.plain_sampled = [DUMMY_TOKEN] * config.scheduler.max_num_seqs
        self.kv_usage: list[tuple[float, float]] = []
        self.steps: list[list[str]] | None = [] if record_steps else None
        self.clock = self.start = trace[0].arrival_time if trace else 0.0

    def run(self) -> SimResult:
        """The whole trace through this one engine."""
        trace, next_arrival = self.trace, 0
        while next_arrival < len(trace) or self.busy or self.pending:
            start = self.next_step_time()
            while next_arrival < len(trace) and (start is None or trace[next_arrival].arrival_time <= start):
                self.send(next_arrival)
                next_arrival += 1
                start = self.next_step_time()
            self.step()
        return self.result()

    @property
    def busy(self) -> bool:
        """Requests in the scheduler or a batch in flight."""
        return bool(self.scheduler.num_unfinished or len(self.loop))

    def send(self, i: int, tokens: list[int] | None = None) -> None:
        """Trace request i is sent to this engine (in arrival order); it reaches the scheduler `request_latency_s`
        later. `tokens`: its prompt, when the sender made it already."""
        self.pending.append((i, tokens))

    def next_step_time(self) -> float | None:
        """When this engine's next step starts (None: idle, nothing sent)."""
        if self.busy:
            return self.clock
        if self.pending:
            return max(self.clock, self.trace[self.pending[0][0]].arrival_time + self.request_latency_s)
        return None

    def step(self) -> None:
        """One turn of the engine's loop at `next_step_time()`: what has reached the scheduler joins it, then
        the step loop launches and/or applies a step (the clock moves to its end)."""
        trace, scheduler, loop, pending = self.trace, self.scheduler, self.loop, self.pending
        if not self.busy:  # idle: jump to the next arrival
            self.clock = max(self.clock, trace[pending[0][0]].arrival_time + self.request_latency_s)
            self.device.idle = True
        while pending and trace[pending[0][0]].arrival_time + self.request_latency_s <= self.clock:
            self._arrive(*pending.popleft())
        if self.speculation is not None:
            self.speculation.propose(scheduler)
        was_in_flight = len(loop)
        out, _ = loop.step()
        if out.is_empty and not was_in_flight and scheduler.num_unfinished and not scheduler.running:
            raise RuntimeError(f"step {out.step}: requests wait but none can be scheduled")
        if self.kv_events is not None:  # as the engine does after each step: the step's KV events, one batch
            self.kv_events.flush()

    def _arrive(self, i: int, tokens: list[int] | None = None) -> None:
        """Trace request i reaches the scheduler, or is refused at the door as a server refuses it (a reason,
        then a colon: `coverage.failure_line` groups them)."""
        r, record = self.trace[i], self.records[i]
        if self.speculation is not None:
            self.speculation.arrive(i, r)
        if tokens is None:
            tokens = prompt_token_ids(r, i, self.seed)
        record.prompt_len = len(tokens)
        limit = self.config.scheduler.max_model_len
        if len(tokens) > limit:
            record.error = f"prompt longer than max_model_len={limit}: {len(tokens)} tokens"
            self._finished(i)
            return
        if len(tokens) + r.output_len > limit:  # vLLM's rule for max_tokens: prompt + completion must fit
            record.error = f"prompt + output longer than max_model_len={limit}: {len(tokens)} + {r.output_len} tokens"
            self._finished(i)
            return
        params = SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True, detokenize=False)
        request = Request(
            str(i),
            tokens,
            params,
            (),
            priority=r.priority,
            arrival_time=r.arrival_time,
            user=r.user,
            expected_output_len=r.output_len if self.oracle_output_len else None,
        )
        self.index[id(request)] = i
        self.scheduler.add_request(request)

    def _finished(self, i: int) -> None:
        self.num_done += 1
        if self.done is not None:
            self.done.append(i)

    def _launch(self, out: SchedulerOutput, previous: InFlightStep | None) -> tuple[object | None, list]:
        if out.is_empty:
            return None, []
        if self.steps is not None:
            self.steps.append([s.request.request_id for s in out.scheduled])
        return self.device.launch(out, self.clock, first_in_flight=previous is None), []

    def _apply(self, step: InFlightStep) -> list:
        """Wait for the batch's last stage, then apply its tokens (the real `Scheduler.update`)."""
        out, batch = step.out, step.result
        self.clock = self.device.finish(batch, self.clock, last_in_flight=not len(self.loop))
        if self.scheduler.draft_budget is not None:  # as the engine feeds it each step's measured time
            self.scheduler.draft_budget.observe_step(out.num_tokens, batch.elapsed)
        sampled = self.plain_sampled if self.speculation is None else self.speculation.verdicts(out, self.index)
        for request, _, count in self.scheduler.update(out, sampled):
            i = self.index[id(request)]
            record = self.records[i]
            record_token(record, self.clock, self.last_token[i], count)
            self.last_token[i] = self.clock
            if request.is_finished:
                record.latency = self.clock - record.start
                record.success = True
                self._finished(i)
        self.kv_usage.append((self.clock - self.start, self.kv.usage))
        return []

    def result(self) -> SimResult:
        scheduler, kv, speculation = self.scheduler, self.kv, self.speculation
        extra = {}
        if speculation is not None and scheduler.spec_stats is not None:
            extra = speculation.summary(scheduler.spec_stats)
        if self.device.pipeline.num_stages > 1:
            extra.update(self.device.summary())
        return SimResult(
            records=self.records,
            duration=self.clock - self.start,
            num_steps=len(self.kv_usage),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            kv_usage=self.kv_usage,
            free_blocks_at_end=kv.num_free_blocks,
            num_usable_blocks=kv.num_usable_blocks,
            steps=self.steps,
            extra=extra,
            draft_tokens=speculation.drafted if speculation is not None else None,
            accepted_tokens=speculation.accepted if speculation is not None else None,
        )

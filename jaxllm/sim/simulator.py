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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jaxllm.bench.results import RequestRecord, summarize
from jaxllm.config import SchedulerConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler, SchedulerOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.sim.costmodel import CostModel, StepShape
from jaxllm.sim.trace import TOKEN_RANGE, TraceRequest, prompt_token_ids

DUMMY_TOKEN = TOKEN_RANGE[0]  # what every simulated step "samples"; lengths are forced, values never matter
MAX_SERIES_POINTS = 2000  # KV-usage samples kept in the JSON (evenly thinned)

StepTime = Callable[[SchedulerOutput], float]


@dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig
    num_blocks: int  # the KV pool, scratch block included (as `ModelRunner.num_blocks`)
    block_size: int = 16
    enable_prefix_caching: bool = True


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


def record_token(record: RequestRecord, now: float, previous: float) -> None:
    """One more token at `now`; `previous` is when the request's last one came."""
    if record.ttft is None:
        record.ttft = now - record.start
    else:
        record.itl.append(now - previous)
    record.output_len += 1


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
) -> SimResult:
    """Run `trace` (sorted by arrival) to completion; `oracle_output_len` tells policies each true output length.

    `request_latency_s` and `idle_wake_s` are `CostModel`'s (see there): a request reaches the scheduler
    that long after it was sent; the first step after the engine was idle takes that much longer.
    """
    for name, value in (("request_latency_s", request_latency_s), ("idle_wake_s", idle_wake_s)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    sched_cfg = config.scheduler
    kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
    if kv.num_usable_blocks * config.block_size < sched_cfg.max_model_len:
        raise ValueError(
            f"the KV pool holds {kv.num_usable_blocks * config.block_size} tokens, fewer than "
            f"max_model_len={sched_cfg.max_model_len}: raise the number of blocks"
        )
    scheduler = Scheduler(sched_cfg, kv)
    records = [RequestRecord(prompt_len=0, start=r.arrival_time) for r in trace]
    index: dict[int, int] = {}  # id(Request) → trace index
    last_token: list[float] = [0.0] * len(trace)
    sampled = [DUMMY_TOKEN] * sched_cfg.max_num_seqs
    kv_usage: list[tuple[float, float]] = []
    steps: list[list[str]] | None = [] if record_steps else None

    def arrive(i: int) -> None:
        r = trace[i]
        tokens = prompt_token_ids(r, i, seed)
        records[i].prompt_len = len(tokens)
        if len(tokens) > sched_cfg.max_model_len:  # the engine refuses it at the door
            records[i].error = f"the prompt has {len(tokens)} tokens, more than max_model_len={sched_cfg.max_model_len}"
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
            expected_output_len=r.output_len if oracle_output_len else None,
        )
        index[id(request)] = i
        scheduler.add_request(request)

    def reaches_engine(i: int) -> float:
        return trace[i].arrival_time + request_latency_s

    clock = trace[0].arrival_time if trace else 0.0
    start = clock
    next_arrival = 0
    idle = True  # the engine has nothing to do before the first arrival
    while next_arrival < len(trace) or scheduler.num_unfinished:
        if not scheduler.num_unfinished:  # idle: jump to the next arrival
            clock = max(clock, reaches_engine(next_arrival))
            idle = True
        while next_arrival < len(trace) and reaches_engine(next_arrival) <= clock:
            arrive(next_arrival)
            next_arrival += 1
        out = scheduler.schedule()
        if out.is_empty:
            if scheduler.num_unfinished and not scheduler.running:
                raise RuntimeError(f"step {out.step}: requests wait but none can be scheduled")
            continue
        if steps is not None:
            steps.append([s.request.request_id for s in out.scheduled])
        clock += step_time(out) + (idle_wake_s if idle else 0.0)
        idle = False
        for request, _, _ in scheduler.update(out, sampled):
            i = index[id(request)]
            record = records[i]
            record_token(record, clock, last_token[i])
            last_token[i] = clock
            if request.is_finished:
                record.latency = clock - record.start
                record.success = True
        kv_usage.append((clock - start, kv.usage))

    return SimResult(
        records=records,
        duration=clock - start,
        num_steps=len(kv_usage),
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        kv_usage=kv_usage,
        free_blocks_at_end=kv.num_free_blocks,
        num_usable_blocks=kv.num_usable_blocks,
        steps=steps,
    )

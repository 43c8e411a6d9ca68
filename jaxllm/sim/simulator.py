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

Speculative decoding (`SimConfig.speculative`, n-gram): before each step every running request
about to decode is given made-up drafts, as many as the engine's `Drafter` would propose (k, or the
load-aware cap's fewer; n-gram proposing is host work, not priced, and finds a match every time
here); the real scheduler decides how many it verifies (the cap again, the token budget, the rows
of logits, max_tokens) and schedules them as extra query rows; the cost model prices that step's
real shape;
and the sampled row of each draft is made to equal the draft exactly as often as the acceptance
model says, so the real `Scheduler.update` accepts that many and appends them plus one token. The
acceptance model: a draft is accepted with probability `acceptance_rate` (the trace request's, else
the run's) given the draft before it was. Whether the draft for a request's output position p is
accepted is drawn once per (seed, request, p), from a generator seeded by the seed: reproducible,
and the same positions are accepted whatever k, load or policy (common random numbers, so two
configurations differ by their own effect, not by luck). The scheduler's `DraftBudget` is fed each
step's simulated time, as the engine feeds it measured ones, so the load-aware rule acts as it would.

Pipeline parallelism (`SimConfig.pipeline_parallel_size` P > 1): the engine's batch queue on the virtual clock.
The scheduler is the engine's under PP (`max_concurrent_batches` = P: each batch takes at most
ceil(max_num_seqs / P) rows, a request is in one batch in flight at most). The loop is the engine's
`_step_pipelined`: when P batches are in flight the oldest is applied first; then a new batch is scheduled and
launched at once (the host does not wait for the device); when none can be scheduled the oldest in flight is
applied. Launching costs the host no time; applying waits for the batch's last stage. The stages are a
pipeline: stage s of a batch starts when stage s - 1 of it and stage s of the batch before it have finished,
and takes the time `PipelineCost` gives it (its layers' share of the step time the cost model prices for the
batch's shape, plus the hidden states' copy into it). The result reports the bubble: the fraction of the
stages' time idle while at least one batch was in flight, (P x busy time - sum of stage times) / (P x busy
time), with the idle periods between requests left out; and the mean number of batches in flight over that busy
time. With P = 1 it is the one-step-at-a-time loop exactly (one stage, the whole step time, nothing to copy).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from jaxllm.bench.results import RequestRecord, summarize
from jaxllm.config import SchedulerConfig, SpeculativeConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.scheduler import Scheduler
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.scheduler_output import SchedulerOutput
from jaxllm.sim.costmodel import (
    DEFAULT_PP_TRANSFER_LATENCY_S,
    DEFAULT_PP_TRANSFER_S_PER_TOKEN,
    CostModel,
    PipelineCost,
    StepShape,
    bucket_tokens,
)
from jaxllm.sim.trace import TOKEN_RANGE, TraceRequest, prompt_token_ids
from jaxllm.spec_decode.stats import SpecDecodingStats

DUMMY_TOKEN = TOKEN_RANGE[0]  # what every simulated step "samples"; lengths are forced, values never matter
DRAFT_TOKEN = DUMMY_TOKEN + 1  # every made-up draft; a row that rejects its draft samples DUMMY_TOKEN instead
MAX_SERIES_POINTS = 2000  # KV-usage samples kept in the JSON (evenly thinned)

StepTime = Callable[[SchedulerOutput], float]


@dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig
    num_blocks: int  # the KV pool, scratch block included (as `ModelRunner.num_blocks`)
    block_size: int = 16
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None  # n-gram speculation (see the module docstring)
    pipeline_parallel_size: int = 1  # stages; the scheduler config gets max_concurrent_batches = this
    pp_stage_layers: tuple[int, ...] | None = None  # layers of each stage (`stage_layers`); None: an even split

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


@dataclass
class _Batch:
    """A batch in flight (pipeline parallelism; with one stage, the step being run)."""

    out: SchedulerOutput
    finish: float  # when its last stage ends
    elapsed: float  # from its launch to `finish`, as summed (the one-stage loop's step time exactly)


def pipeline_summary(pipeline: PipelineCost, stage_busy: list[float], busy_time: float, batch_time: float) -> dict:
    """The result JSON's pipeline figures (the module docstring): the bubble and batches in flight over the
    time at least one batch was in flight, each stage's busy fraction of it, and the model's parameters."""
    stages = pipeline.num_stages
    return {
        "pipeline_parallel_size": stages,
        "pp_stage_shares": list(pipeline.stage_shares),
        "pp_transfer_latency_s": pipeline.transfer_latency_s,
        "pp_transfer_s_per_token": pipeline.transfer_s_per_token,
        "pp_busy_s": busy_time,
        "pp_bubble_fraction": 1 - sum(stage_busy) / (stages * busy_time) if busy_time else None,
        "pp_mean_batches_in_flight": batch_time / busy_time if busy_time else None,
        "pp_stage_utilization": [b / busy_time if busy_time else None for b in stage_busy],
    }


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


def acceptance_draws(seed: int) -> np.random.Generator:
    """The generator of the acceptance model's draws (a stable digest of the seed, apart from the prompts')."""
    key = hashlib.blake2b(f"{seed}/acceptance".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(key, "little"))


def spec_summary(stats: SpecDecodingStats, num_decodes: int) -> dict:
    """Speculation's counters (vLLM's names) and derived figures for the result JSON. `num_decodes`: request
    steps that computed one known token (with or without drafts to verify), i.e. could speculate; the
    speculated fraction is how many did (the load-aware cap, the token budget and the rows of logits, or
    max_tokens, left the others none)."""
    return {
        "spec_decode_num_drafts": stats.num_drafts,
        "spec_decode_num_draft_tokens": stats.num_draft_tokens,
        "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
        "spec_decode_num_accepted_tokens_per_pos": list(stats.accepted_per_pos),
        "spec_decode_acceptance_rate": stats.acceptance_rate,
        "spec_decode_mean_acceptance_length": stats.mean_acceptance_length,
        "spec_decode_num_decodes": num_decodes,
        "spec_decode_speculated_fraction": stats.num_drafts / num_decodes if num_decodes else None,
        "spec_decode_mean_draft_tokens": stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else None,
    }


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
    record has none (see the module docstring).
    `pp_transfer_latency_s`, `pp_transfer_s_per_token`: with `config.pipeline_parallel_size` > 1, the copy of
    a batch's hidden states across each stage boundary (`PipelineCost`); unused with one stage.
    """
    for name, value in (("request_latency_s", request_latency_s), ("idle_wake_s", idle_wake_s)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    speculative = config.speculative
    if acceptance_rate is not None and not 0 <= acceptance_rate <= 1:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
    if speculative is not None and acceptance_rate is None:
        missing = sum(1 for r in trace if r.acceptance_rate is None)
        if missing:
            raise ValueError(
                f"speculation needs an acceptance rate: {missing} trace request(s) carry none and no global "
                f"rate was given (--acceptance-rate)"
            )
    sched_cfg = config.scheduler
    kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
    if kv.num_usable_blocks * config.block_size < sched_cfg.max_model_len:
        raise ValueError(
            f"the KV pool holds {kv.num_usable_blocks * config.block_size} tokens, fewer than "
            f"max_model_len={sched_cfg.max_model_len}: raise the number of blocks"
        )
    scheduler = Scheduler(sched_cfg, kv, speculative)
    pipeline = config.pipeline_cost(pp_transfer_latency_s, pp_transfer_s_per_token)
    num_stages = pipeline.num_stages
    records = [RequestRecord(prompt_len=0, start=r.arrival_time) for r in trace]
    index: dict[int, int] = {}  # id(Request) → trace index
    last_token: list[float] = [0.0] * len(trace)
    plain_sampled = [DUMMY_TOKEN] * sched_cfg.max_num_seqs
    kv_usage: list[tuple[float, float]] = []
    steps: list[list[str]] | None = [] if record_steps else None
    draws = acceptance_draws(seed) if speculative is not None else None
    accepts: dict[int, np.ndarray] = {}  # trace index → whether the draft for output position p is accepted
    num_decodes = 0
    drafted, accepted_total = [0] * len(trace), [0] * len(trace)

    def arrive(i: int) -> None:
        r = trace[i]
        if draws is not None:  # drawn for every request in trace order, refused ones too: the same draws per index
            rate = r.acceptance_rate if r.acceptance_rate is not None else acceptance_rate
            assert rate is not None  # checked above
            accepts[i] = draws.random(r.output_len) < rate
        tokens = prompt_token_ids(r, i, seed)
        records[i].prompt_len = len(tokens)
        limit = sched_cfg.max_model_len
        # refused at the door, each as a server refuses it (a reason, then a colon: `coverage.failure_line` groups them)
        if len(tokens) > limit:
            records[i].error = f"prompt longer than max_model_len={limit}: {len(tokens)} tokens"
            return
        if len(tokens) + r.output_len > limit:  # vLLM's rule for max_tokens: prompt + completion must fit
            records[
                i
            ].error = f"prompt + output longer than max_model_len={limit}: {len(tokens)} + {r.output_len} tokens"
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

    def propose() -> None:
        """As the engine's `Drafter` between steps: each running request that decodes next gets drafts, as many
        as the load-aware cap allows (none at all when it allows none). n-gram proposing costs no device time."""
        assert speculative is not None and scheduler.draft_budget is not None
        decoding = []
        for request in scheduler.running:
            request.draft_token_ids = []
            # (a request in a batch still in flight, under PP, gets none: the engine's Drafter skips it)
            if request.num_tokens - request.num_computed_tokens == 1 and not scheduler.has_step_in_flight(request):
                decoding.append(request)
        k = speculative.num_speculative_tokens
        cap = scheduler.draft_budget.cap([k] * len(decoding), 0) if decoding else 0
        drafts = [DRAFT_TOKEN] * cap  # one list for all: nothing mutates it
        for request in decoding:
            request.draft_token_ids = drafts

    def verdicts(out: SchedulerOutput) -> list[int]:
        """A token per row of logits: each verified draft's row equals it while the acceptance model accepts."""
        nonlocal num_decodes
        sampled = [DUMMY_TOKEN] * out.num_rows
        for s in out.scheduled:
            request, d = s.request, len(s.draft_token_ids)
            if s.samples and s.num_new_tokens - d == 1:  # a decode: a step that may verify drafts
                num_decodes += 1
            if d:
                i = index[id(request)]
                first = request.num_output_tokens  # the output position the first draft stands for
                n = 0
                while n < d and accepts[i][first + n]:
                    n += 1
                sampled[s.logits_row : s.logits_row + n] = s.draft_token_ids[:n]
                drafted[i] += d
                accepted_total[i] += n
        return sampled

    def reaches_engine(i: int) -> float:
        return trace[i].arrival_time + request_latency_s

    clock = trace[0].arrival_time if trace else 0.0
    start = clock
    next_arrival = 0
    idle = True  # the engine has nothing to do before the first arrival
    in_flight: deque[_Batch] = deque()  # launched, not yet applied, oldest first (the engine's BatchQueue)
    stage_free = [clock] * num_stages  # when each stage finishes the last batch given to it
    stage_busy = [0.0] * num_stages
    busy_since, busy_time, batch_time = clock, 0.0, 0.0  # time with a batch in flight; batches x time in flight

    def launch(out: SchedulerOutput) -> None:
        """Put `out` through the stages, each after the batch before it there (`_Batch` records when it ends)."""
        nonlocal idle, busy_since
        bucket = bucket_tokens(out.num_tokens, sched_cfg.max_num_batched_tokens)
        durations = pipeline.stage_times(step_time(out), bucket)
        durations[0] += idle_wake_s if idle else 0.0
        idle = False
        if not in_flight:
            busy_since = clock
        elapsed = 0.0  # from the launch to the end of the stage so far
        for s, seconds in enumerate(durations):
            elapsed = max(elapsed, stage_free[s] - clock) + seconds
            stage_free[s] = clock + elapsed
            stage_busy[s] += seconds
        in_flight.append(_Batch(out, clock + elapsed, elapsed))

    def apply(batch: _Batch) -> None:
        """Wait for the batch's last stage, then apply its tokens (the real `Scheduler.update`)."""
        nonlocal clock, busy_time, batch_time
        out, seconds = batch.out, batch.elapsed  # launch to applied, as the engine measures it for the draft cap
        clock = max(clock, batch.finish)  # (the host waits only for the oldest batch: never later than its end)
        batch_time += seconds
        if not in_flight:
            busy_time += clock - busy_since
        if scheduler.draft_budget is not None:  # as the engine feeds it each step's measured time
            scheduler.draft_budget.observe_step(out.num_tokens, seconds)
        sampled = plain_sampled if speculative is None else verdicts(out)
        for request, _, count in scheduler.update(out, sampled):
            i = index[id(request)]
            record = records[i]
            record_token(record, clock, last_token[i], count)
            last_token[i] = clock
            if request.is_finished:
                record.latency = clock - record.start
                record.success = True
        kv_usage.append((clock - start, kv.usage))

    while next_arrival < len(trace) or scheduler.num_unfinished or in_flight:
        if len(in_flight) >= num_stages:  # the queue is full: the oldest batch first
            apply(in_flight.popleft())
            continue
        if not scheduler.num_unfinished and not in_flight:  # idle: jump to the next arrival
            clock = max(clock, reaches_engine(next_arrival))
            idle = True
        while next_arrival < len(trace) and reaches_engine(next_arrival) <= clock:
            arrive(next_arrival)
            next_arrival += 1
        if speculative is not None:
            propose()
        out = scheduler.schedule()
        if not out.is_empty:
            if steps is not None:
                steps.append([s.request.request_id for s in out.scheduled])
            launch(out)
            continue
        if in_flight:  # nothing new can start: the oldest batch in flight
            apply(in_flight.popleft())
            continue
        if scheduler.num_unfinished and not scheduler.running:
            raise RuntimeError(f"step {out.step}: requests wait but none can be scheduled")

    extra = spec_summary(scheduler.spec_stats, num_decodes) if scheduler.spec_stats is not None else {}
    if num_stages > 1:
        extra.update(pipeline_summary(pipeline, stage_busy, busy_time, batch_time))
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
        extra=extra,
        draft_tokens=drafted if speculative is not None else None,
        accepted_tokens=accepted_total if speculative is not None else None,
    )

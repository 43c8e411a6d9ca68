"""A cluster on one virtual clock: N simulated engines behind the router's own policy objects (`jaxllm simulate
--instances N --router POLICY`).

Each instance is the simulator's engine (simulator.py `SimEngine`: the real `Scheduler` and `KVCacheManager`,
priced by the cost model). The instances advance in virtual-time order — a heap of each busy instance's next step
start — and a request is routed at its arrival time, before any instance steps past it, by a policy from
`jaxllm.routing` (the classes `jaxllm router` uses, loaded by `routing.registry.load_policy`). What the policy
sees is what a router sees: a `ClusterView` of `InstanceState`s whose running/waiting are each scheduler's as the
router's load poll last read them (every `poll_interval_s`, the router's health-check interval; a step in progress
at a poll has been applied already, so the numbers can be one step ahead of a real poll's), `dispatched` the
requests sent to it since, `in_flight` those not finished; and, for a policy that reads block
hashes, a `PrefixIndex` fed by the KV events each instance's KV manager publishes (the engine's own listener,
`kv_events.publisher.KVEventCollector`, one batch per step)
— never the KV managers themselves. A request's block hashes are the engine's and the router's
(engine/block_hash.py `prefix_hashes`, from the KV manager's root) over the trace's made-up prompt tokens
(sim/trace.py: a session's turns extend one another); its session key is the trace's `session`, else its `user`.

Per step the work is the stepping instance's (O(scheduled)); per request, the policy's (the registry's policies
scan the instances' loads; prefix matching walks the index from block hash to instances, never the instances).
Nothing is random beyond the seed of the made-up tokens: the same trace, seed and policy give the same run, and
one trace run under several policies is a paired comparison. With one instance the run is `simulate`'s.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxllm.bench.results import RequestRecord, summarize
from jaxllm.engine.block_hash import prefix_hashes
from jaxllm.kv_events.events import EventBatch
from jaxllm.kv_events.index import PrefixIndex
from jaxllm.kv_events.publisher import KVEventCollector
from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.view import DEFAULT_HEALTH_CHECK_INTERVAL_S, ClusterView, InstanceState, RouteRequest
from jaxllm.sim.costmodel import DEFAULT_PP_TRANSFER_LATENCY_S, DEFAULT_PP_TRANSFER_S_PER_TOKEN, PipelineCost
from jaxllm.sim.simulator import SimConfig, SimEngine, SimResult
from jaxllm.sim.trace import TraceRequest, prompt_token_ids
from jaxllm.sim.virtual_device import StepTime, VirtualDevice


class _IndexSink:
    """An in-process event sink: each published batch goes straight into the shared prefix index."""

    def __init__(self, index: PrefixIndex, instance: str):
        self.index, self.instance = index, instance

    def publish(self, batch: EventBatch) -> None:
        self.index.apply(self.instance, batch)

    def close(self) -> None:
        pass


@dataclass
class ClusterResult:
    router: str
    names: list[str]  # the instances' names (the prefix index's keys)
    instances: list[SimResult]  # each instance's run; its records: the requests it served, in trace order
    records: list[RequestRecord]  # one per trace request, in trace order
    assigned: list[int]  # the instance each trace request was routed to
    duration: float  # makespan: first arrival to the last token of any instance
    extra: dict = field(default_factory=dict)
    engines: list[SimEngine] = field(default_factory=list, repr=False)  # the instances at the end (their KV, ...)

    @property
    def prefix_cache_queries(self) -> int:
        return sum(r.prefix_cache_queries for r in self.instances)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(r.prefix_cache_hits for r in self.instances)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens read from a prefix cache / prompt tokens looked up, over the cluster."""
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    def to_json(self, **summary_kwargs) -> dict:
        """`simulate`'s keys for the cluster as a whole (the KV-usage series left out), `router` and `instances`,
        and `per_instance`: each instance's own (its requests; its makespan)."""
        result = summarize(self.records, self.duration, **summary_kwargs)
        runs = [r.to_json(**summary_kwargs) for r in self.instances]
        for run in runs:
            del run["kv_cache_usage"]
        usage = [u for r in self.instances for _, u in r.kv_usage] or [0.0]
        result.update(
            {
                "router": self.router,
                "instances": len(self.instances),
                "num_steps": sum(r.num_steps for r in self.instances),
                "num_preemptions": sum(r.num_preemptions for r in self.instances),
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "mean_kv_cache_usage": sum(usage) / len(usage),
                "max_kv_cache_usage": max(usage),
                **self.extra,
                "per_instance": [{"name": name, **run} for name, run in zip(self.names, runs, strict=True)],
            }
        )
        return result


def priced_engine(
    trace: list[TraceRequest],
    config: SimConfig,
    step_time: StepTime,
    pipeline: PipelineCost,
    records: list[RequestRecord],
    *,
    seed: int,
    request_latency_s: float,
    idle_wake_s: float,
    oracle_output_len: bool = False,
) -> SimEngine:
    """One simulated instance of a cluster, its steps priced by `step_time` on a virtual device of its own."""
    engine = SimEngine(trace, config, seed, oracle_output_len, request_latency_s, None, False, records)
    limit = config.scheduler.max_num_batched_tokens
    engine.device = VirtualDevice(pipeline, step_time, limit, idle_wake_s, engine.clock)
    return engine


class SimFleet:
    """Simulated instances on one virtual clock, and what a router knows of each (`states`, as it keeps them).

    `next_step` is the earliest start among the busy instances' next steps (a heap; inf when all are idle);
    `send` hands an instance a request, `step` runs the earliest step, `poll` reads every instance's load as the
    router's poll does."""

    def __init__(self, names: list[str], engines: list[SimEngine]):
        self.names, self.engines = names, engines
        self.states = [InstanceState(name) for name in names]
        self.sent = [0] * len(engines)
        self.queued = [False] * len(engines)
        self.heap: list[tuple[float, int]] = []  # (next step's start, instance) of each instance with work

    @property
    def next_step(self) -> float:
        return self.heap[0][0] if self.heap else math.inf

    def send(self, k: int, i: int, tokens: list[int] | None = None) -> None:
        self.engines[k].send(i, tokens)
        self.sent[k] += 1
        state = self.states[k]
        state.dispatched += 1
        state.in_flight += 1
        if not self.queued[k]:  # a busy instance's next start does not move; an idle one's is this arrival's
            start = self.engines[k].next_step_time()
            assert start is not None
            heapq.heappush(self.heap, (start, k))
            self.queued[k] = True

    def step(self, *, track_load: bool) -> int:
        """The earliest step; returns its instance. `track_load`: its state takes the scheduler's load after it
        (a router polling as often as the instances step); the requests still open on it are always tracked."""
        _, k = heapq.heappop(self.heap)
        engine, state = self.engines[k], self.states[k]
        engine.step()
        state.in_flight = self.sent[k] - engine.num_done
        if track_load:
            state.running, state.waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
            state.dispatched = len(engine.pending)
        start = engine.next_step_time()
        if start is None:
            self.queued[k] = False
        else:
            heapq.heappush(self.heap, (start, k))
        return k

    def poll(self) -> None:
        for engine, state in zip(self.engines, self.states, strict=True):
            state.running, state.waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
            state.dispatched = 0

    def runs(
        self, assigned: list[int], records_of: Callable[[int], list[RequestRecord]]
    ) -> tuple[list[SimResult], float]:
        """Each instance's result (its records: those of the requests it served, `assigned`, in trace order) and
        the makespan: first arrival to the last step of any instance."""
        served: list[list[RequestRecord]] = [[] for _ in self.engines]
        for i, k in enumerate(assigned):
            served[k].append(records_of(k)[i])
        runs = []
        for engine, mine in zip(self.engines, served, strict=True):
            run = engine.result()
            run.records = mine
            runs.append(run)
        start = min(e.start for e in self.engines)
        return runs, max(e.clock for e in self.engines) - start


def simulate_cluster(
    trace: list[TraceRequest],
    config: SimConfig,
    step_time: StepTime,
    num_instances: int,
    policy: RoutingPolicy,
    *,
    seed: int = 0,
    oracle_output_len: bool = False,
    request_latency_s: float = 0.0,
    idle_wake_s: float = 0.0,
    pp_transfer_latency_s: float = DEFAULT_PP_TRANSFER_LATENCY_S,
    pp_transfer_s_per_token: float = DEFAULT_PP_TRANSFER_S_PER_TOKEN,
    kv_events: bool | None = None,
    poll_interval_s: float = DEFAULT_HEALTH_CHECK_INTERVAL_S,
) -> ClusterResult:
    """Run `trace` (sorted by arrival) on `num_instances` equal engines behind `policy`.

    `step_time` prices every instance's steps (stateless: a cost model's); the other keywords are `simulate`'s.
    `kv_events`: attach the KV-events listener to every instance and feed the prefix index (None: when the
    policy reads block hashes, as a router subscribes to KV events for it). `poll_interval_s`: how often the
    router reads each instance's running and waiting requests (`jaxllm router --health-check-interval`, whose
    default this is); between reads a policy sees those counts plus what was sent since (`dispatched`), as the
    router does; 0: after every step of the instance.
    """
    if num_instances < 1:
        raise ValueError(f"--instances must be >= 1, got {num_instances}")
    if config.speculative is not None:
        raise ValueError("the cluster simulation does not simulate speculative decoding yet")
    for name, value in (
        ("request_latency_s", request_latency_s),
        ("idle_wake_s", idle_wake_s),
        ("poll_interval_s", poll_interval_s),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    pipeline = config.pipeline_cost(pp_transfer_latency_s, pp_transfer_s_per_token)
    records = [RequestRecord(prompt_len=0, start=r.arrival_time) for r in trace]
    names = [f"sim-{k}" for k in range(num_instances)]
    index = PrefixIndex()
    publish = policy.needs_block_hashes if kv_events is None else kv_events
    engines = []
    for name in names:
        engine = priced_engine(
            trace,
            config,
            step_time,
            pipeline,
            records,
            seed=seed,
            request_latency_s=request_latency_s,
            idle_wake_s=idle_wake_s,
            oracle_output_len=oracle_output_len,
        )
        if publish:
            sink = _IndexSink(index, name)
            collector = KVEventCollector(sink, block_size=config.block_size, scope=engine.kv.root.hex())
            engine.kv.listener = engine.kv_events = collector
        engines.append(engine)
    fleet = SimFleet(names, engines)
    states = fleet.states
    view = ClusterView(states, index)
    root, scope = engines[0].kv.root, engines[0].kv.root.hex()
    hashed = policy.needs_block_hashes
    assigned = [-1] * len(trace)
    next_arrival, n = 0, len(trace)
    next_poll = trace[0].arrival_time if trace else 0.0
    while next_arrival < n or fleet.heap:
        if next_arrival < n and trace[next_arrival].arrival_time <= fleet.next_step:
            i, r = next_arrival, trace[next_arrival]
            next_arrival += 1
            if poll_interval_s and r.arrival_time >= next_poll:  # the router's load poll came round
                next_poll += (int((r.arrival_time - next_poll) // poll_interval_s) + 1) * poll_interval_s
                fleet.poll()
            tokens = None
            request = RouteRequest(session=r.session if r.session is not None else r.user)
            if hashed and r.prompt is None:
                tokens = prompt_token_ids(r, i, seed)
                hashes = prefix_hashes(tokens, config.block_size, root)
                request = RouteRequest(hashes, scope, session=request.session)
            k = _index_of(policy.choose(request, view), states)
            assigned[i] = k
            fleet.send(k, i, tokens)
            continue
        fleet.step(track_load=not poll_interval_s)
    runs, duration = fleet.runs(assigned, lambda _: records)
    name = getattr(policy, "name", type(policy).__name__)
    return ClusterResult(name, names, runs, records, assigned, duration, engines=engines)


def _index_of(state: InstanceState, states: list[InstanceState]) -> int:
    """The instance a policy chose (`InstanceState.name` is "sim-K")."""
    k = int(state.name.rpartition("-")[2])
    if states[k] is not state:
        raise ValueError(f"the policy returned {state.name!r}, not one of the view's instances")
    return k

"""Disaggregated prefill and decode in the cluster simulator: `jaxllm simulate --pd P:D`.

What `jaxllm router --prefill ... --decode ...` does (docs/disaggregated.md), on one virtual clock: each request goes
to the least loaded of P prefill instances with one token to generate (the producer's `max_tokens: 1`); when that
finishes, its prompt's K/V crosses to the least loaded of D decode instances, taking `transfer_latency_s +
prompt tokens x transfer_s_per_token`, and the request arrives there (the router's second call, the front's
`request_latency_s` again). A decode instance's scheduler has a KV connector (`HandoffConnector`) that supplies every
prompt token its own prefix cache lacks but the last, loaded synchronously, as the TransferConnector's consumer does
once the pull has ended: its first step computes one token and samples the request's first output token, which is
the client's first token (the producer's is discarded, as the router discards it). TTFT and latencies count from
the request's arrival at the router.

Each instance is the simulator's engine (the real scheduler and KV manager, priced by the cost model), so a
prefill instance batches prompts and hits its prefix cache, and a decode instance batches decodes, exactly as
`SimEngine` does for one engine. Not modelled: a producer keeps a finished prompt's blocks until the consumer has
pulled them (here they go back at once), and a transfer shares no bandwidth with another.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

from jaxllm.bench.results import RequestRecord
from jaxllm.kv_transfer.base import KVConnectorScheduler
from jaxllm.kv_transfer.stats import KVTransferStats
from jaxllm.request import Request
from jaxllm.routing.view import least_loaded
from jaxllm.sim.cluster import ClusterResult, SimFleet, priced_engine
from jaxllm.sim.costmodel import DEFAULT_PP_TRANSFER_LATENCY_S, DEFAULT_PP_TRANSFER_S_PER_TOKEN
from jaxllm.sim.simulator import SimConfig, SimEngine
from jaxllm.sim.trace import TraceRequest
from jaxllm.sim.virtual_device import StepTime

# benchmarks/results/kv_transfer_cpu.json: the TransferConnector moved a 480-token prompt's K/V of the default
# model (float32, 47,616 bytes a token) at 0.71 GB/s on this 2-core machine
DEFAULT_KV_TRANSFER_GB_S = 0.71
DEFAULT_KV_TRANSFER_LATENCY_S = 0.005


class HandoffConnector(KVConnectorScheduler):
    """A decode instance's connector: the prompt's K/V (all but its last token) is there, loaded by the time the
    request arrives; its own prefix cache's hits are read first, as a consumer's are."""

    def __init__(self, kv) -> None:  # nothing of the base's but what the scheduler reads
        self.kv, self.block_size, self.stats = kv, kv.block_size, KVTransferStats()
        self._loads, self._remote_loads, self._saves, self._sends = [], [], [], []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return max(request.num_prompt_tokens - 1 - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, tables, num_external_tokens: int) -> None:
        pass


def parse_pd(text: str) -> tuple[int, int]:
    """`--pd P:D` → (P, D), each at least 1."""
    p, sep, d = text.partition(":")
    try:
        counts = int(p), int(d)
    except ValueError:
        counts = (0, 0)
    if not sep or min(counts) < 1:
        raise ValueError(f"--pd takes PREFILL:DECODE instance counts such as 1:1 or 2:3, got {text!r}")
    return counts


def simulate_pd(
    trace: list[TraceRequest],
    config: SimConfig,
    step_time: StepTime,
    num_prefill: int,
    num_decode: int,
    *,
    kv_bytes_per_token: int,
    seed: int = 0,
    request_latency_s: float = 0.0,
    idle_wake_s: float = 0.0,
    kv_transfer_gb_s: float = DEFAULT_KV_TRANSFER_GB_S,
    kv_transfer_latency_s: float = DEFAULT_KV_TRANSFER_LATENCY_S,
) -> ClusterResult:
    """Run `trace` (sorted by arrival) on `num_prefill` prefill and `num_decode` decode instances, each the
    calibrated engine (`config`), the router choosing the least loaded of each kind."""
    if min(num_prefill, num_decode) < 1:
        raise ValueError(f"P/D needs at least one prefill and one decode instance, got {num_prefill}:{num_decode}")
    if config.speculative is not None:
        raise ValueError("the cluster simulation does not simulate speculative decoding yet")
    if not kv_transfer_gb_s > 0 or kv_transfer_latency_s < 0:
        raise ValueError("the KV transfer needs a bandwidth > 0 GB/s and a latency >= 0 s")
    s_per_token = kv_bytes_per_token / (kv_transfer_gb_s * 1e9)
    pipeline = config.pipeline_cost(DEFAULT_PP_TRANSFER_LATENCY_S, DEFAULT_PP_TRANSFER_S_PER_TOKEN)
    n = len(trace)
    records = [RequestRecord(prompt_len=0, start=r.arrival_time) for r in trace]  # the client's: decode's tokens
    prefill_records = [RequestRecord(prompt_len=0, start=r.arrival_time) for r in trace]
    prefill_trace = [replace(r, output_len=1) for r in trace]  # the producer's `max_tokens: 1`
    decode_trace = list(trace)  # each entry's arrival becomes its handoff's when it is sent

    def instance(of: list[TraceRequest], filled: list[RequestRecord]) -> SimEngine:
        return priced_engine(
            of,
            config,
            step_time,
            pipeline,
            filled,
            seed=seed,
            request_latency_s=request_latency_s,
            idle_wake_s=idle_wake_s,
        )

    engines: list[SimEngine] = []
    for k in range(num_prefill + num_decode):
        if k < num_prefill:
            engine = instance(prefill_trace, prefill_records)
            engine.done = []
        else:
            engine = instance(decode_trace, records)
            engine.scheduler.connector = HandoffConnector(engine.kv)
        engines.append(engine)
    names = [f"prefill-{k}" for k in range(num_prefill)] + [f"decode-{k}" for k in range(num_decode)]
    fleet = SimFleet(names, engines)
    states = fleet.states
    assigned = [-1] * n  # the decode instance each request ended on (its prefill instance when it failed there)
    handoffs: list[tuple[float, int]] = []  # (arrival at a decode instance, request)
    transfer_s: list[float] = []
    next_arrival = 0
    while next_arrival < n or fleet.heap or handoffs:
        arrival = trace[next_arrival].arrival_time if next_arrival < n else math.inf
        handoff = handoffs[0][0] if handoffs else math.inf
        if arrival <= min(handoff, fleet.next_step):  # a request reaches the router: to a prefill instance
            k = states.index(least_loaded(states[:num_prefill], next_arrival))
            assigned[next_arrival] = k
            fleet.send(k, next_arrival)
            next_arrival += 1
        elif handoff <= fleet.next_step:  # its K/V is across: the router's second call, to a decode instance
            when, i = heapq.heappop(handoffs)
            k = num_prefill + states[num_prefill:].index(least_loaded(states[num_prefill:], i))
            decode_trace[i] = replace(trace[i], arrival_time=when)
            assigned[i] = k
            fleet.send(k, i)
        else:
            engine = engines[fleet.step(track_load=True)]
            for i in engine.done or ():
                if prefill_records[i].success:
                    seconds = kv_transfer_latency_s + prefill_records[i].prompt_len * s_per_token
                    transfer_s.append(seconds)
                    heapq.heappush(handoffs, (engine.clock + seconds, i))
                else:  # refused by the producer: the router answers its error
                    records[i].prompt_len, records[i].error = prefill_records[i].prompt_len, prefill_records[i].error
            if engine.done:
                engine.done.clear()
    runs, duration = fleet.runs(assigned, lambda k: prefill_records if k < num_prefill else records)
    prefill = runs[:num_prefill]
    queries, hits = sum(r.prefix_cache_queries for r in prefill), sum(r.prefix_cache_hits for r in prefill)
    extra = {
        "prefill_instances": num_prefill,
        "decode_instances": num_decode,
        "kv_transfer_gb_s": kv_transfer_gb_s,
        "kv_transfer_latency_s": kv_transfer_latency_s,
        "mean_kv_transfer_ms": 1000 * sum(transfer_s) / len(transfer_s) if transfer_s else 0.0,
        "prefill_prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }
    return ClusterResult(f"pd {num_prefill}:{num_decode}", names, runs, records, assigned, duration, extra, engines)

"""The objective: a setting's highest sustainable request rate (Vidur's capacity search).

The trace's arrivals are scaled in time (rate x s: every gap divided by s; lengths, prompts, tenants and
prefixes unchanged) and replayed in the simulator. A rate is sustainable when at least `fraction` of the
requests meet every SLO (`--goodput`, as `jaxllm bench serve` counts goodput). The rates tried lie on a
geometric grid, the trace's own rate x 2^(k/STEPS_PER_DOUBLING) for integer k, so equal rates compare
exactly (and ties go to the tie-breakers); the search doubles (or halves) from the trace's rate until it
brackets the boundary, then bisects k. It assumes the goodput fraction falls as the rate rises.

`--max-rate` searches one setting on a Poisson process instead (`poisson`): the trace's requests at fresh,
seeded exponential gaps of rate r0; since the gaps scale exactly with the rate, the same bisection on its time
scaling tries Poisson arrivals at r0 x 2^(k/STEPS_PER_DOUBLING), the arrivals `jaxllm bench serve --request-rate R
--seed S` sends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from jaxllm.engine.args import EngineArgs
from jaxllm.routing.registry import load_policy
from jaxllm.sim.cluster import ClusterResult, simulate_cluster
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.pd import parse_pd, simulate_pd
from jaxllm.sim.settings import SimSettings, sim_config, simulate_priced
from jaxllm.sim.simulator import SimConfig, SimResult, cost_model_step_time
from jaxllm.sim.trace import TraceRequest
from jaxllm.tune.space import kv_bytes_per_block

STEPS_PER_DOUBLING = 16  # rate resolution: 2^(1/16), 4.4 %
MAX_DOUBLINGS = 10  # rates searched: the trace's own / 1024 .. x 1024


def trace_rate(trace: list[TraceRequest]) -> float:
    """The trace's own request rate: gaps per second between its first and last arrival."""
    if len(trace) < 2:
        raise ValueError("the trace needs at least two requests to have a request rate to scale")
    span = trace[-1].arrival_time - trace[0].arrival_time
    if span <= 0:
        raise ValueError(
            "the trace's requests all arrive at one instant: scaling its arrivals cannot change its rate "
            "(make one with `jaxllm trace synth --request-rate R`)"
        )
    return (len(trace) - 1) / span


def poisson(trace: list[TraceRequest], rate: float, seed: int) -> list[TraceRequest]:
    """The trace's requests at Poisson arrivals of `rate` per second, drawn as `jaxllm bench serve --request-rate
    RATE --seed SEED` draws them (`retime`): `scaled(poisson(t, r, s), f)` is `poisson(t, r * f, s)`."""
    from jaxllm.bench.datasets import retime

    return retime(trace, rate, seed=seed)


def scaled(trace: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """The trace at `factor` times its rate: each arrival's offset from the first divided by `factor`."""
    first = trace[0].arrival_time
    return [dataclasses.replace(r, arrival_time=first + (r.arrival_time - first) / factor) for r in trace]


def sim_config_of(args: EngineArgs, cost: CostModel) -> SimConfig:
    """The simulator's config for these engine arguments. With pipeline parallelism `kv_cache_memory_bytes` is
    each stage's budget for its own layers' K/V (runner/pipeline.py), so the pool holds more blocks."""
    assert args.kv_cache_memory_bytes is not None  # base_engine_args fills it
    budget_blocks = args.kv_cache_memory_bytes // kv_bytes_per_block(cost, args.block_size)
    return sim_config(SimSettings.of(args, budget_blocks=budget_blocks), cost)


@dataclass
class Run:
    """One simulation: the bench-serve keys and the goodput fraction (requests within every SLO / all)."""

    summary: dict
    fraction: float
    misses: dict[str, float]  # per SLO: the metric at the goodput fraction's quantile / the SLO (> 1: missed)


@dataclass
class Capacity:
    max_request_rate: float  # 0: no rate tried is sustainable
    k: int | None  # its grid index (None: none sustainable)
    at_trace: Run  # the trace as given
    lowest: Run  # at the lowest rate tried (what an unsustainable setting misses by)
    at_max: Run | None = None  # at max_request_rate (None: none sustainable)
    below: float | None = None  # pruned: the true rate is below this (and max_request_rate a lower bound)
    simulations: int = 0
    fractions: dict[int, float] = field(default_factory=dict)  # k -> goodput fraction


class Objective:
    """Simulates settings on a workload; `capacity(args)` is the objective."""

    def __init__(
        self,
        trace: list[TraceRequest],
        cost: CostModel,
        slos: dict[str, float],
        fraction: float = 0.99,
        seed: int = 0,
        *,
        rate: float | None = None,
        acceptance_rate: float | None = None,
        instances: int = 1,
    ):
        """`rate`: the rate the trace stands for (default: its own, `trace_rate`; a Poisson trace's process rate);
        `acceptance_rate`: speculation's, for requests whose trace record carries none (`simulate`'s);
        `instances` > 1: the trace goes to that many equal instances behind a router (sim/cluster.py), its policy
        each run's `router`."""
        if not slos:
            raise ValueError("--goodput needs at least one SLO, e.g. ttft:500 tpot:50")
        if not 0 < fraction <= 1:
            raise ValueError(f"--goodput-fraction must be in (0, 1], got {fraction}")
        self.trace, self.cost, self.slos, self.fraction, self.seed = trace, cost, slos, fraction, seed
        self.rate = rate if rate is not None else trace_rate(trace)
        self.acceptance_rate = acceptance_rate
        self.instances = instances
        self.simulations = 0
        self.best_k: int | None = None  # the best sustainable grid index found so far (for pruning)

    def rate_at(self, k: int) -> float:
        return self.rate * 2 ** (k / STEPS_PER_DOUBLING)

    def run(self, args: EngineArgs, k: int = 0, router: str | None = None) -> Run:
        from jaxllm.bench.results import summarize

        trace = self.trace if k == 0 else scaled(self.trace, 2 ** (k / STEPS_PER_DOUBLING))
        config = sim_config_of(args, self.cost)
        sim: SimResult | ClusterResult
        if self.instances > 1:
            step_time = cost_model_step_time(self.cost, config)
            if router is not None and router.startswith("pd "):
                p, d = parse_pd(router.removeprefix("pd "))
                per_token = kv_bytes_per_block(self.cost, config.block_size) // config.block_size
                events = self.cost.event_costs()
                sim = simulate_pd(
                    trace, config, step_time, p, d, kv_bytes_per_token=per_token, seed=self.seed, **events
                )
            else:
                policy = load_policy(router or "round_robin")
                sim = simulate_cluster(
                    trace, config, step_time, self.instances, policy, seed=self.seed, **self.cost.event_costs()
                )
        else:
            sim = simulate_priced(trace, config, self.cost, seed=self.seed, acceptance_rate=self.acceptance_rate)
        self.simulations += 1
        summary = summarize(sim.records, sim.duration, goodput=self.slos)
        good = round(summary["request_goodput"] * summary["duration"])
        done = [r for r in sim.records if r.success]
        misses = {}
        q = 100 * self.fraction
        for key, slo in self.slos.items():
            values = [v for r in done if (v := {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}[key]) is not None]
            worst = float(np.percentile(values, q)) * 1000 if values else float("inf")
            misses[key] = worst / slo if slo > 0 else (0.0 if worst == 0 else float("inf"))
        if len(done) < len(sim.records):
            misses["failed"] = len(sim.records) - len(done)
        return Run(summary, good / len(self.trace), misses)

    def capacity(self, args: EngineArgs, router: str | None = None) -> Capacity:
        """The highest sustainable rate on the grid. Once the setting is known to fall short of the best
        sustainable rate found so far (a rate at or below it fails), the search for it stops: its rate is then
        a lower bound and `below` an upper one (pruning; the result depends on the order settings are tried in,
        which is fixed)."""
        before = self.simulations
        runs: dict[int, Run] = {}
        floor = self.best_k

        def ok(k: int) -> bool:
            if k not in runs:
                runs[k] = self.run(args, k, router)
            return runs[k].fraction >= self.fraction

        step, limit = STEPS_PER_DOUBLING, MAX_DOUBLINGS * STEPS_PER_DOUBLING
        low: int | None
        if ok(0):  # double until a rate fails (or the grid's top holds)
            low = 0
            while low + step <= limit and ok(low + step):
                low += step
            high: int | None = None if low + step > limit else low + step
        else:  # halve until a rate holds (or none down to the grid's bottom does)
            low, high = None, 0
            while high - step >= -limit and (floor is None or high > floor):
                if ok(high - step):
                    low = high - step
                    break
                high -= step
        # bisect: ok(low), not ok(high); stop once high <= floor (the setting cannot reach the best)
        while low is not None and high is not None and high - low > 1 and (floor is None or high > floor):
            mid = (low + high) // 2
            if ok(mid):
                low = mid
            else:
                high = mid
        pruned = high is not None and floor is not None and high <= floor and (low is None or high - low > 1)
        if low is not None and not pruned and (self.best_k is None or low > self.best_k):
            self.best_k = low
        return Capacity(
            max_request_rate=self.rate_at(low) if low is not None else 0.0,
            k=low,
            at_trace=runs[0],
            lowest=runs[min(runs)],
            at_max=runs.get(low) if low is not None else None,
            below=self.rate_at(high) if pruned and high is not None else None,
            simulations=self.simulations - before,
            fractions={k: r.fraction for k, r in sorted(runs.items())},
        )

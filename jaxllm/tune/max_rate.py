"""The `jaxllm tune --max-rate` driver: one setting's highest sustainable Poisson request rate, by the capacity
search's bisection on a seeded Poisson process (`capacity.poisson`); optionally served at that rate and compared
(docs/tuning.md)."""

from __future__ import annotations

import time

from jaxllm.engine.args import EngineArgs
from jaxllm.sim.trace import TraceRequest
from jaxllm.tune import report, validate
from jaxllm.tune.capacity import MAX_DOUBLINGS, STEPS_PER_DOUBLING, Capacity, Objective, poisson, scaled, trace_rate
from jaxllm.tune.job import NO_ACCEPTANCE, TuneJob, prepare
from jaxllm.tune.search import Candidate
from jaxllm.tune.space import SEARCHABLE, SPECULATION, speculation_depth


def max_rate(job: TuneJob) -> dict:
    """The highest Poisson rate at which the engine flags' setting meets the job's SLOs; returns the result JSON
    and prints the rate found."""
    work = prepare(job)
    base = work.base
    if base.speculative_config is not None and not work.acceptance_known:
        raise ValueError(NO_ACCEPTANCE)
    if base.max_num_batched_tokens < base.max_num_seqs:  # type: ignore[operator]  # base_engine_args fills them
        raise ValueError("max_num_batched_tokens must be >= max_num_seqs (the engine refuses it)")
    try:  # the grid starts at the trace's own rate; a trace arriving at once starts at 1 req/s
        start = trace_rate(work.trace)
    except ValueError:
        start = 1.0
    arrivals = poisson(work.trace, start, job.seed)
    objective = Objective(
        arrivals,
        work.cost,
        job.slos,
        job.goodput_fraction,
        seed=job.seed,
        rate=start,
        acceptance_rate=job.acceptance_rate,
    )
    setting = setting_of(base)
    print(
        f"Highest Poisson rate for {report.short(setting)}: {len(work.trace)} requests ({job.trace}), "
        f"{job.slos_line()}; bisection from {start:.3g} req/s (seed {job.seed})",
        flush=True,
    )
    started = time.perf_counter()
    capacity = objective.capacity(base)
    seconds = time.perf_counter() - started
    candidate = Candidate(setting, base, capacity)
    if capacity.k is None or capacity.at_max is None:
        raise ValueError(report.unmeetable([candidate], start / 2**MAX_DOUBLINGS, job.goodput_fraction))
    rate, at_max = capacity.max_request_rate, capacity.at_max
    above = capacity.k + 1 if capacity.k + 1 in capacity.fractions else None
    predicted = {**at_max.summary, "goodput_fraction": at_max.fraction, "max_request_rate": rate}
    print(
        f"max sustainable Poisson rate: {rate:.3f} req/s"
        + (f" (fails at {objective.rate_at(above):.3f})" if above is not None else " (the top of the grid)")
        + f"; {objective.simulations} simulations in {seconds:.2f} s; at it (predicted): "
        f"goodput {at_max.fraction:.1%}, "
        f"mean TTFT {at_max.summary['mean_ttft_ms']:.1f} ms, mean TPOT {at_max.summary['mean_tpot_ms']:.1f} ms"
    )
    served = scaled(arrivals, 2 ** (capacity.k / STEPS_PER_DOUBLING))
    validated = served_at(job, candidate, served, predicted) if job.validate else None
    result = {
        **job.common_json(work),
        "arrivals": {"process": "poisson", "seed": job.seed, "start_rate": start},
        "setting": setting,
        "engine_args": report.engine_args_dict(base),
        "max_request_rate": rate,
        # the next rate on the grid, which failed (None: the top of the grid held)
        "max_request_rate_below": objective.rate_at(above) if above is not None else None,
        "rates": rates_json(objective, capacity, job.goodput_fraction),
        "slo_attainment": at_max.misses,
        "predicted": predicted,
        "validated": validated,
        "search": {"simulations": objective.simulations, "seconds": seconds},
        "command": report.serve_command(base),
        "bench_command": bench_command(job, rate),
    }
    job.save(result)
    return result


def setting_of(base: EngineArgs) -> dict:
    """The setting as the search names it: the default space's arguments, and the other searchable ones where
    not at their defaults."""
    setting = {name: getattr(base, name) for name in ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy")}
    defaults = EngineArgs()
    for name in SEARCHABLE:
        if name not in setting and name != "kv_cache_memory_bytes" and hasattr(base, name):
            if getattr(base, name) != getattr(defaults, name):
                setting[name] = getattr(base, name)
    if speculation_depth(base):
        setting[SPECULATION] = speculation_depth(base)
    return setting


def rates_json(objective: Objective, capacity: Capacity, fraction: float) -> list[dict]:
    """Every rate simulated and whether it held."""
    return [
        {"request_rate": objective.rate_at(k), "goodput_fraction": f, "sustainable": f >= fraction}
        for k, f in capacity.fractions.items()
    ]


def bench_command(job: TuneJob, rate: float) -> str:
    """The `jaxllm bench serve` line that sends the very arrivals simulated to a server of one's own."""
    return (
        f"jaxllm bench serve --dataset-name jsonl --dataset-path {job.trace} --request-rate {rate!r} "
        f"--seed {job.seed} --goodput " + " ".join(f"{k}:{v:g}" for k, v in job.slos.items())
    )


def served_at(job: TuneJob, candidate: Candidate, served: list[TraceRequest], predicted: dict) -> dict:
    """`--validate 1`: the setting served for real with the arrivals simulated at the rate found, side by side
    with the prediction."""
    rate = predicted["max_request_rate"]
    measured = validate.measure(candidate, served, job.slos, seed=job.seed)
    validated = {
        "request_rate": rate,
        "compared": validate.side_by_side(predicted, measured),
        "measured": measured,
        "slos_hold": measured["goodput_fraction"] >= job.goodput_fraction,
    }
    print(report.validation_table([{"setting": candidate.setting, **validated}]))
    print(
        f"measured at {rate:.3f} req/s: {measured['goodput_fraction']:.1%} of requests within every SLO "
        f"({'holds' if validated['slos_hold'] else 'does not hold'}: {job.goodput_fraction:.0%} asked)"
    )
    return validated

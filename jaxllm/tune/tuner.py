"""The search driver behind `jaxllm tune`: the space, each setting's highest sustainable rate in the simulator,
the ranking, optionally the top settings served for real, and the result (docs/tuning.md)."""

from __future__ import annotations

import time
from functools import partial

from jaxllm.engine.args import EngineArgs
from jaxllm.tune import report, validate
from jaxllm.tune.capacity import MAX_DOUBLINGS, Objective
from jaxllm.tune.job import NO_ACCEPTANCE, TuneJob, Workload, prepare
from jaxllm.tune.search import Candidate, search
from jaxllm.tune.space import ROUTER, SEARCHABLE, SPECULATION, Space, build_space, speculation_depth, with_setting


def tune(
    job: TuneJob,
    explicit: dict[str, list],
    *,
    full_grid: bool = False,
    plot: str | None = None,
    progress: bool = True,
) -> dict:
    """Searches `explicit` (`--search`, parsed; empty: the default space) and returns the result JSON; prints the
    ranking and the winner as it goes."""
    work = prepare(job)
    space = settings_space(job, work, explicit)
    objective = Objective(
        work.trace,
        work.cost,
        job.slos,
        job.goodput_fraction,
        seed=job.seed,
        acceptance_rate=job.acceptance_rate,
        instances=job.instances,
    )
    print(
        f"Tuning {len(work.trace)} requests at {objective.rate:.2f} req/s ({job.trace}), {job.slos_line()}; "
        + (f"{job.instances} instances behind a router; " if job.instances > 1 else "")
        + f"max_model_len {work.base.max_model_len}; space {space.size} settings: "
        + ", ".join(f"{k}={v}" for k, v in space.values.items()),
        flush=True,
    )
    started = time.perf_counter()
    candidates = search(space, partial(evaluate, work.base, objective), full=full_grid, progress=progress)
    seconds = time.perf_counter() - started
    if not candidates:
        raise ValueError("no setting in the space is one the engine accepts (max_num_batched_tokens >= max_num_seqs)")
    if candidates[0].max_request_rate == 0:
        raise ValueError(report.unmeetable(candidates, objective.rate / 2**MAX_DOUBLINGS, job.goodput_fraction))
    print(report.table(candidates, job.slos))
    print(
        f"{len(candidates)} settings of {space.size} tried, {objective.simulations} simulations in {seconds:.1f} s"
        + ("; search restricted: " + "; ".join(space.restricted) if space.restricted else "")
    )
    best, rows = candidates[0], None
    if job.validate:
        rows = validate.validate(candidates, work.trace, job.slos, job.validate, seed=job.seed)
        print(report.validation_table(rows))
        best = candidates[validate.measured_winner(rows)]
    search_json = {
        "space": space.values,
        "restricted": space.restricted,
        "full_grid": full_grid,
        "grid_size": space.size,
        "settings_tried": len(candidates),
        "simulations": objective.simulations,
        "seconds": seconds,
    }
    result = result_json(job, work, objective, search_json, candidates, best, rows)
    print(f"best ({result['chosen_by']}): {report.short(best.setting)}, {best.max_request_rate:.2f} req/s sustainable")
    print("serve it with:", result["command"])
    if job.instances > 1:
        print(f"on each of {job.instances} instances, routed by:", result["router_command"])
    if plot:
        print("plots:", ", ".join(str(p) for p in report.save_plots(candidates, job.slos, plot)))
    job.save(result)
    return result


def settings_space(job: TuneJob, work: Workload, explicit: dict[str, list]) -> Space:
    """What is searched: `explicit`, else the default space; the engine flags fix the rest."""
    given = job.engine
    fixed = {name: getattr(given, name, None) for name in SEARCHABLE}
    fixed[SPECULATION] = speculation_depth(given) if given.speculative_config is not None else None
    space = build_space(
        explicit, work.cost, work.trace, fixed, acceptance_known=work.acceptance_known, instances=job.instances
    )
    speculating = any(space.values.get(SPECULATION, [])) or work.base.speculative_config is not None
    if speculating and not work.acceptance_known:
        raise ValueError(NO_ACCEPTANCE)
    return space


def evaluate(base: EngineArgs, objective: Objective, setting: dict) -> Candidate | None:
    """The setting's highest sustainable rate; None for a setting the engine refuses."""
    engine = with_setting(base, setting)
    tokens, seqs = engine.max_num_batched_tokens, engine.max_num_seqs
    assert tokens is not None and seqs is not None  # base_engine_args fills them
    if tokens < seqs:  # the engine refuses it
        return None
    return Candidate(setting, engine, objective.capacity(engine, setting.get(ROUTER)))


def result_json(
    job: TuneJob,
    work: Workload,
    objective: Objective,
    search_json: dict,
    candidates: list[Candidate],
    best: Candidate,
    rows: list[dict] | None,
) -> dict:
    return {
        **job.common_json(work),
        "trace_request_rate": objective.rate,
        "search": search_json,
        "candidates": [report.candidate_json(c) for c in candidates],
        "best": report.engine_args_dict(best.args),
        "best_setting": best.setting,
        "chosen_by": "measured" if rows else "predicted",
        "predicted": {
            **best.capacity.at_trace.summary,
            "goodput_fraction": best.capacity.at_trace.fraction,
            "max_request_rate": best.max_request_rate,
        },
        "validated": rows,
        "command": report.serve_command(best.args),
        **(
            {"instances": job.instances, "router_command": report.router_command(job.instances, best.setting[ROUTER])}
            if job.instances > 1
            else {}
        ),
    }

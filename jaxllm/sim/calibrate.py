"""Calibration (`jaxllm calibrate`): time real compiled steps on this machine and fit the cost model.

Two passes over one loaded engine, and one over a server:

1. **Device sweep**: synthetic `SchedulerOutput`s straight into `ModelRunner.execute` over a grid
   of (sequences, tokens per sequence, context) — pure decode batches at several context lengths,
   single prefill chunks of every bucket size at several starting positions, mixed steps
   (decodes plus one prefill chunk), and speculative decoding's verification steps (sequences of
   d + 1 query rows, d drafts each, alone and beside a prefill chunk). Each point is timed as the
   median of a few rounds over the whole sweep, after one warm run (`time_sweep`). Rows sample
   greedily, as every replay does (`forced_params`): a sampled row adds the random draw to the
   step. This fits the bucket bases and the context, attention and per-row terms.
2. **Engine pass**: a short synthetic trace through the whole `EngineCore` (scheduling, input
   assembly, sampling, output bookkeeping), each step timed start to next start as the simulator
   counts it. The residual over the device model is fitted as a per-step plus per-sequence host
   overhead (a median fit, `fit_host_overhead`), which the cost model then includes. Then a light
   trace with idle gaps (`light_trace`) and a busy one (`busy_trace`) through the same engine fit
   `idle_wake_s` and `per_prefill_step_s` together on TTFT (`fit_event_costs`): the first step after
   the engine sat idle runs slower (measured: a 48-token prefill +28-43 %), and so may every step
   that carries a prefill chunk when other work shares the CPU.
3. **Server pass** (`calibrate_server`, on by default in the CLI): the light and busy traces through
   a child `jaxllm serve` with the same engine flags, replayed by `jaxllm bench serve`'s client.
   The costs, each from its own evidence: per step, the median over the light trace's requests of
   real minus simulated TPOT, not below zero (the event loop streaming to clients shares the CPU
   with the steps); per request, `request_latency_s` = the client's mean TTFT minus the server's own
   (its /metrics histogram), i.e. HTTP and the hand-offs, measured rather than fitted, so step-time
   errors cannot hide in it; per idle period and per prefill step, `idle_wake_s` and
   `per_prefill_step_s` again, as the server meets them (`fit_event_costs`): there the front end's
   work for arriving requests and first tokens lands on prefill steps, which leave it no free core.

The fit errors go into the JSON (`fit`).
"""

from __future__ import annotations

import logging
import platform
import time
from contextlib import ExitStack
from dataclasses import replace
from datetime import UTC, datetime

import jax
import numpy as np

from jaxllm.config import SchedulerConfig
from jaxllm.engine.args import EngineArgs
from jaxllm.runner.kv_cache import bytes_per_block
from jaxllm.sim.costmodel import CostModel, fit_cost_model
from jaxllm.sim.engine_run import run_trace_on_engine
from jaxllm.sim.progress import Progress, last_line
from jaxllm.sim.simulator import SimConfig, cost_model_step_time, simulate
from jaxllm.sim.sweep import sweep_points, time_sweep, verification_fit
from jaxllm.sim.synth import LengthDist, synthesize

logger = logging.getLogger("jaxllm")


# the engine pass's mean prompt at most: it fits per-step and per-row host work, which prompt length does not
# change; at `jaxllm serve`'s CPU shapes (64 sequences, 512-token steps) uncapped prompts took minutes of prefill
ENGINE_PASS_MAX_PROMPT = 128


def engine_pass_trace(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, seed: int = 0):
    """A short overload trace (everything at t=0) mixing short and chunked prompts, decodes dominating."""
    mean_prompt = min(max_num_batched_tokens, max_model_len // 4, ENGINE_PASS_MAX_PROMPT)
    prompt = LengthDist(mean_prompt, "uniform", range_ratio=0.9)
    output = LengthDist(max(2, min(24, max_model_len // 8)), "uniform", range_ratio=0.8)
    return synthesize(3 * max_num_seqs, request_rate=float("inf"), input_len=prompt, output_len=output, seed=seed)


def fit_host_overhead(num_seqs: np.ndarray, residual: np.ndarray, iterations: int = 50) -> tuple[float, float]:
    """`per_step + per_seq * num_seqs` through the residuals, by least absolute deviations (IRLS).

    A median fit, not least squares: on a shared machine a few steps are slowed many-fold by other
    work, and a mean would spread those over every step (seen: a 45 ms "overhead" on 60 ms steps).
    Both terms are kept non-negative.
    """
    x = np.stack([np.ones_like(num_seqs), num_seqs], axis=1)
    weights = np.ones_like(residual)
    for _ in range(iterations):
        coef, *_ = np.linalg.lstsq(x * weights[:, None], residual * weights, rcond=None)
        weights = 1.0 / np.sqrt(np.maximum(np.abs(residual - x @ coef), 1e-6))
    per_step, per_seq = float(coef[0]), float(coef[1])
    if per_seq < 0:
        per_step, per_seq = float(np.median(residual)), 0.0
    return max(per_step, 0.0), per_seq


def calibrate(core, *, repeats: int = 5, progress: bool | Progress = True) -> CostModel:
    """Fit a cost model for `core`'s model, shapes and machine (see the module docstring); `progress`: a line
    per part and bars on stderr."""
    say = progress if isinstance(progress, Progress) else Progress(progress)
    sched = core.config.scheduler
    # tokens of context the pool holds for sure: a step's new tokens take a block per group (windows or not)
    capacity = core.kv.num_free_blocks * core.kv.block_size // len(core.kv.windows)
    points = sweep_points(sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len, capacity)
    say.say(f"device sweep: {len(points)} step shapes x {repeats} rounds (each point's median), after a warm run")
    samples = time_sweep(core, points, repeats, say.enabled)
    moe = core.loaded.arch.moe
    model = fit_cost_model(samples, sched.max_num_batched_tokens, moe and (moe.num_experts, moe.top_k))
    model.fit.update(verification_fit(model, samples, sched.max_num_batched_tokens))
    say.say(f"device fit: mean |error| {model.fit['mean_abs_rel_error']:.1%} over {len(samples)} steps")

    trace = engine_pass_trace(sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len)
    say.say(f"engine pass: {len(trace)} requests at once through the whole engine, a warm run and a timed one")
    run_trace_on_engine(
        core,
        engine_pass_trace(sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len, seed=1),
        progress="Engine pass (warm)" if say.enabled else None,
    )  # warm: first-use costs off the fit
    run = run_trace_on_engine(core, trace, progress="Engine pass" if say.enabled else None)
    measured = np.array(run.durations())
    seqs = np.array([s.shape.num_rows for s in run.steps], dtype=float)  # the per-row term (c) takes it
    residual = measured - np.array([model.step_time(s.shape, sched.max_num_batched_tokens) for s in run.steps])
    per_step, per_seq = fit_host_overhead(seqs, residual)
    model = replace(
        model, bucket_base_s=[b + per_step for b in model.bucket_base_s], per_seq_s=model.per_seq_s + float(per_seq)
    )
    predicted = np.array([model.step_time(s.shape, sched.max_num_batched_tokens) for s in run.steps])
    rel = np.abs(predicted - measured) / measured
    model.fit.update(
        {
            "engine_steps": len(run.steps),
            "engine_mean_abs_rel_error": float(rel.mean()),
            "engine_p90_abs_rel_error": float(np.percentile(rel, 90)),
            "engine_total_rel_error": float(abs(predicted.sum() - measured.sum()) / measured.sum()),
            "host_overhead_per_step_s": per_step,
            "host_overhead_per_seq_s": float(per_seq),
        }
    )
    model.engine = engine_description(core)
    light, busy = light_trace(sched.max_model_len), busy_trace(sched.max_model_len)
    say.say(
        f"engine host overhead: +{per_step * 1e3:.1f} ms per step, +{per_seq * 1e3:.2f} ms per row; now a light trace "
        f"({len(light)} requests over {light[-1].arrival_time:.0f} s) and a busy one ({len(busy)} over "
        f"{busy[-1].arrival_time:.0f} s) in real time: the idle wake-up and the prefill-step cost"
    )
    bar = say.enabled
    model, fit = fit_event_costs(
        model,
        light,
        run_trace_on_engine(core, light, progress="Light trace" if bar else None).records,
        busy,
        run_trace_on_engine(core, busy, seed=BUSY_SEED, progress="Busy trace" if bar else None).records,
    )
    model.fit.update({f"engine_{k}": v for k, v in fit.items()})
    return model


def engine_description(core) -> dict:
    """What `CostModel.engine` records: the shapes, pool and machine the model was measured on."""
    sched = core.config.scheduler
    return {
        "model": core.loaded.name,
        "dtype": core.loaded.dtype.name,
        "platform": jax.default_backend(),
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": sched.max_model_len,
        "block_size": core.kv.block_size,
        "num_blocks": core.runner.num_blocks,
        "enable_prefix_caching": core.config.cache.enable_prefix_caching,
        "num_layers": core.loaded.arch.num_layers,  # the simulator's pipeline split (`jaxllm simulate`)
        "tensor_parallel_size": core.config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": core.config.parallel.pipeline_parallel_size,
        "kv_bytes_per_block": bytes_per_block(
            core.loaded.arch,
            core.kv.block_size,
            core.loaded.dtype,
            core.runner.mesh.shape["model"],
            core.runner.kv_groups.slots,
        ),
        # the hybrid KV manager's groups: a window per group (None: full attention)
        "kv_cache_groups": list(core.kv.windows),
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        **machine_speed_keys(),
        "quantization": core.loaded.quant.describe(),
        "kv_cache_dtype": core.config.cache.cache_dtype,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def machine_speed_keys() -> dict:
    """What decides this machine's step times beyond its name: the CPU model, and the vector ISA and -march the
    C++ kernels are built for (a VM moved to another host keeps its name; `jaxllm tune` compares these)."""
    from jaxllm.bench.offline import cpu_name

    keys = {"cpu": cpu_name()}
    if jax.default_backend() == "cpu":
        from pallas_kernels import cpu_ffi

        keys["kernel_target"] = f"{cpu_ffi.isa()} (-march={cpu_ffi.march()})"
    return keys


def light_trace(max_model_len: int, seed: int = 3):
    """A light trace (about one request in flight at a time) of short prompts and outputs."""
    prompt = LengthDist(min(48, max_model_len // 4), "uniform", range_ratio=0.5)
    output = LengthDist(max(4, min(16, max_model_len // 8)), "uniform", range_ratio=0.5)
    return synthesize(16, request_rate=1.0, input_len=prompt, output_len=output, seed=seed)


BUSY_SEED = 1  # the busy trace's prompt tokens: request i's must differ from the light trace's (no prefix hits)


def busy_trace(max_model_len: int, seed: int = 4):
    """Requests overlapping (three a second) with prompts of one to three chunks: prefill steps run while
    other requests decode, arrive and get their first token."""
    prompt = LengthDist(min(96, max_model_len // 4), "uniform", range_ratio=0.8)
    output = LengthDist(max(4, min(16, max_model_len // 8)), "uniform", range_ratio=0.5)
    return synthesize(24, request_rate=3.0, input_len=prompt, output_len=output, seed=seed)


def calibrate_server(model: CostModel, server_flags: list[str], *, progress: bool | Progress = True) -> CostModel:
    """Add the serving front-end's costs, the idle wake-up and the prefill-step cost to `model` as a server
    meets them (the module docstring, pass 3)."""
    import asyncio

    from jaxllm.bench.serve import first_model, run
    from jaxllm.bench.server_process import ServerProcess

    say = progress if isinstance(progress, Progress) else Progress(progress)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    trace, busy = light_trace(model.engine["max_model_len"]), busy_trace(model.engine["max_model_len"])
    server = ServerProcess(server_flags)
    say.say(f"server pass: a child `jaxllm serve` with the same engine flags (its log: {server.log_path})")
    started = time.monotonic()
    with ExitStack() as stack:
        with say.waiting("Starting jaxllm serve", last_line(server.log_path)):
            stack.enter_context(server)  # returns once it answers /health
        say.say(
            f"server up in {time.monotonic() - started:.0f} s; replaying the light trace ({len(trace)} requests "
            f"over {trace[-1].arrival_time:.0f} s), then the busy one ({len(busy)} over {busy[-1].arrival_time:.0f} s)"
        )
        name = first_model(server.url, {})
        url = server.url + "/v1/completions"
        records, _ = asyncio.run(run(trace, url=url, model=name, headers={}, progress=say.enabled))
        metrics = server.metrics()
        busy_records, _ = asyncio.run(run(busy, url=url, model=name, headers={}, seed=BUSY_SEED, progress=say.enabled))
    failed = [r.error for r in records + busy_records if not r.success]
    if failed:
        raise RuntimeError(f"server pass: {len(failed)} requests failed, e.g. {failed[0]}")

    # per step: the event loop streaming to clients shares the CPU with the steps. Never negative: a
    # server faster than the model is the machine's speed drifting between the passes (seen: -2.3 ms
    # here, then the validation's real steps 8 % slower)
    measured_per_step = float(
        np.median([r.tpot - s.tpot for r, s in zip(records, simulated(model, trace), strict=True)])
    )
    per_step = max(measured_per_step, 0.0)
    model = replace(model, bucket_base_s=[b + per_step for b in model.bucket_base_s])
    # per request: the client's TTFT minus the server's own (arrival at its front to the first token out)
    served_ttft = (
        metrics["jaxllm:time_to_first_token_seconds_sum"] / metrics["jaxllm:time_to_first_token_seconds_count"]
    )
    model = replace(model, request_latency_s=max(float(np.mean([r.ttft for r in records])) - served_ttft, 0.0))
    model, fit = fit_event_costs(model, trace, records, busy, busy_records)

    check = simulated(model, trace)
    real_ttft, real_tpot = sum(_measured(r.ttft) for r in records), sum(_measured(r.tpot) for r in records)
    ttft_err = abs(sum(_measured(s.ttft) for s in check) - real_ttft) / real_ttft
    tpot_err = abs(sum(_measured(s.tpot) for s in check) - real_tpot) / real_tpot
    model.fit.update(
        {
            "server_requests": len(records),
            "server_overhead_per_step_s": per_step,
            "server_measured_per_step_s": measured_per_step,
            **{f"server_{k}": v for k, v in fit.items()},
            "server_mean_ttft_rel_error": ttft_err,
            "server_mean_tpot_rel_error": tpot_err,
        }
    )
    return model


def fit_event_costs(
    model: CostModel, light, light_records, busy, busy_records, iterations: int = 30
) -> tuple[CostModel, dict]:
    """`model` with `per_prefill_step_s` and `idle_wake_s` fitted together on real runs of the light and
    busy traces, and what the fit rests on.

    The light trace's requests mostly find the engine idle, so their TTFT carries the wake-up and the
    prefill-step cost together; the busy trace's carry mostly the prefill-step cost. So: for a trial
    `p`, fit the wake on the light trace; choose the `p` (bisection, 0-100 ms) at which the busy trace's
    simulated mean TTFT equals the real one."""
    real = float(np.mean([r.ttft for r in busy_records]))

    def with_p(p: float) -> tuple[CostModel, int, float]:
        fitted, idle = fit_idle_wake(replace(model, per_prefill_step_s=p), light, light_records)
        return fitted, idle, float(np.mean([r.ttft for r in simulated(fitted, busy, seed=BUSY_SEED)])) - real

    low, high = 0.0, 0.1
    fitted, idle, error = with_p(low)
    if error < 0:  # the busy trace runs slower than the model: some p > 0 makes up for it
        for _ in range(iterations):
            mid = (low + high) / 2
            fitted, idle, error = with_p(mid)
            low, high = (mid, high) if error < 0 else (low, mid)
    return fitted, {
        "idle_wake_s": fitted.idle_wake_s,
        "per_prefill_step_s": fitted.per_prefill_step_s,
        "idle_arrivals": idle,
        "busy_requests": len(busy_records),
        "busy_mean_ttft_rel_error": error / real,
    }


def fit_idle_wake(model: CostModel, trace, records) -> tuple[CostModel, int]:
    """`model` with `idle_wake_s` fitted on a real run of `trace` (its `records`), and the number of
    requests it rests on: the median over requests that found the engine idle of real minus
    simulated TTFT, not below zero."""
    sim = simulated(replace(model, idle_wake_s=0.0), trace)
    idle = [i for i, s in enumerate(sim) if all(p.start + p.latency <= s.start for p in sim[:i])]
    wake = max(float(np.median([records[i].ttft - sim[i].ttft for i in idle])), 0.0) if idle else 0.0
    return replace(model, idle_wake_s=wake), len(idle)


def _measured(value: float | None) -> float:
    """A calibration request's TTFT or TPOT: every one has both (it succeeded, with at least 2 tokens)."""
    if value is None:
        raise ValueError("a calibration request has no TTFT or TPOT (it failed, or has fewer than 2 tokens)")
    return value


def simulated(model: CostModel, trace, seed: int = 0) -> list:
    """Each request's record in a simulation of `trace` on `model`'s engine with `model`'s costs."""
    config = sim_config_for(model.engine)
    return simulate(trace, config, cost_model_step_time(model, config), seed=seed, **model.event_costs()).records


def sim_config_for(engine: dict) -> SimConfig:
    """The simulator's view of a calibrated engine (`CostModel.engine`)."""
    return SimConfig(
        SchedulerConfig(engine["max_num_seqs"], engine["max_num_batched_tokens"], engine["max_model_len"]),
        num_blocks=engine["num_blocks"],
        block_size=engine["block_size"],
        enable_prefix_caching=engine["enable_prefix_caching"],
    )


def engine_args_for(engine: dict) -> EngineArgs:
    """Engine arguments that rebuild a calibrated engine (`CostModel.engine`): its shapes and KV pool."""
    return EngineArgs(
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_model_len=engine["max_model_len"],
        block_size=engine["block_size"],
        dtype=engine["dtype"],
        enable_prefix_caching=engine["enable_prefix_caching"],
        kv_cache_memory_bytes=kv_bytes_for(engine),
    )


def kv_bytes_for(engine: dict) -> int:
    """The `kv_cache_memory_bytes` that gives a calibrated engine's KV pool again."""
    return engine["num_blocks"] * engine["kv_bytes_per_block"]

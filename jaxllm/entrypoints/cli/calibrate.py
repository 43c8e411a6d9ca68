"""`jaxllm calibrate --out cost.json`: time real compiled steps on this machine and fit the simulator's cost model."""

from __future__ import annotations

import argparse
import dataclasses

from jaxllm.engine.args import EngineArgs

# the test suite's shapes: few buckets to compile (and JAX's cache usually has them), minutes in all
CALIBRATION_DEFAULTS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512}


def register(sub) -> None:
    parser = sub.add_parser(
        "calibrate",
        help="fit the simulator's step-time model on this machine",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="the cost model JSON to write")
    parser.add_argument("--repeats", type=int, default=5, help="rounds over the sweep (each point keeps its median)")
    parser.add_argument(
        "--server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also fit what `jaxllm serve` adds (a child server on a light trace), for simulating "
        "a server; --no-server models the offline engine",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run, **CALIBRATION_DEFAULTS)


def run(args) -> None:
    from jaxllm.engine.core import EngineCore
    from jaxllm.sim.calibrate import calibrate, calibrate_server, kv_bytes_for

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.speculative_config is not None:
        raise ValueError(
            "calibrate times verification steps itself (drafts as extra rows) and replays its traces without "
            "speculation: leave out --speculative-config, and give it to `jaxllm simulate` instead"
        )
    core = EngineCore(engine_args)
    model = calibrate(core, repeats=args.repeats)
    if args.server:
        del core  # the server loads its own engine
        same_pool = dataclasses.replace(engine_args, kv_cache_memory_bytes=kv_bytes_for(model.engine))
        model = calibrate_server(model, same_pool.to_cli_args())
    model.save(args.out)
    fit = model.fit
    print(
        f"cost model ({model.form}) fitted on {fit['samples']} device steps: mean |error| "
        f"{fit['mean_abs_rel_error']:.1%}, p90 {fit['p90_abs_rel_error']:.1%}; on {fit['engine_steps']} engine steps: "
        f"mean {fit['engine_mean_abs_rel_error']:.1%}, total time {fit['engine_total_rel_error']:.1%}; "
        f"{event_costs(fit, 'engine')}"
    )
    if fit.get("verify_samples"):
        print(
            f"verification steps (speculative decoding, {fit['verify_samples']} of the device steps): mean |error| "
            f"{fit['verify_mean_abs_rel_error']:.1%}, max {fit['verify_max_abs_rel_error']:.1%}"
        )
    if args.server:
        print(
            f"server: +{fit['server_overhead_per_step_s'] * 1e3:.1f} ms per step, "
            f"{model.request_latency_s * 1e3:.1f} ms per request, {event_costs(fit, 'server')}; "
            f"mean TTFT error {fit['server_mean_ttft_rel_error']:.1%}, "
            f"mean TPOT error {fit['server_mean_tpot_rel_error']:.1%} on {fit['server_requests']} requests"
        )
    print(f"wrote {args.out}")


def event_costs(fit: dict, prefix: str) -> str:
    return (
        f"+{fit[prefix + '_idle_wake_s'] * 1e3:.1f} ms on the first step after idling, "
        f"+{fit[prefix + '_per_prefill_step_s'] * 1e3:.1f} ms per prefill step"
    )

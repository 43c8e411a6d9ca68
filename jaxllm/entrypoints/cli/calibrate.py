"""`jaxllm calibrate --out cost.json`: time real compiled steps on this machine and fit the simulator's cost model.

It calibrates the engine `jaxllm serve` runs with the same flags, so by default serve's own: the model's whole
context, and serve's batch and token budget for the platform. A cost model covers only the shapes it measured
(`jaxllm simulate` and `jaxllm tune` refuse longer requests and extrapolate or leave out larger shapes), so a
calibration of smaller shapes than the server's would describe another server.
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxllm.engine.args import ACCELERATOR_DEFAULTS, CPU_DEFAULTS, EngineArgs

# the flags that decide what a cost model covers, with their defaults (serve's) spelled out for --help
SHAPE_HELP = {
    "max_model_len": "the longest request (prompt + output) the cost model holds (default: as `jaxllm serve`, "
    "the model's maximum: 8192 for the default model)",
    "max_num_seqs": f"sequences per step (default: as `jaxllm serve`, {CPU_DEFAULTS['max_num_seqs']} on a CPU, "
    f"{ACCELERATOR_DEFAULTS['max_num_seqs']} on an accelerator)",
    "max_num_batched_tokens": "tokens per step, the largest bucket timed (default: as `jaxllm serve`, "
    f"{CPU_DEFAULTS['max_num_batched_tokens']} on a CPU, {ACCELERATOR_DEFAULTS['max_num_batched_tokens']} on an "
    "accelerator)",
    "kv_cache_memory_bytes": "the KV pool (default: as `jaxllm serve`, a share of free memory)",
}


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except where the help text says it in words (a default of None)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def register(sub) -> None:
    parser = sub.add_parser(
        "calibrate",
        help="fit the simulator's step-time model on this machine",
        description="Time real steps of the engine `jaxllm serve` would run with these flags (its defaults unless "
        "given) and fit the cost model `jaxllm simulate` and `jaxllm tune` use. At serve's CPU defaults this takes "
        "minutes on a small machine; smaller shapes are quicker but cover less, e.g. the test suite's: "
        "--max-model-len 512 --max-num-seqs 8 --max-num-batched-tokens 64.",
        formatter_class=DefaultsFormatter,
        conflict_handler="resolve",  # the shape flags below replace EngineArgs' with their help
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
    shapes = parser.add_argument_group("what the cost model covers")
    for name, text in SHAPE_HELP.items():
        shapes.add_argument("--" + name.replace("_", "-"), type=int, default=None, metavar=name.upper(), help=text)
    parser.set_defaults(func=run)


def coverage_line(engine: dict) -> str:
    """What a calibration covers, from `CostModel.engine` (or the engine about to be calibrated)."""
    return (
        f"{engine['model']} ({engine['dtype']}, {engine['platform']}): max_model_len {engine['max_model_len']}, "
        f"max_num_seqs {engine['max_num_seqs']}, max_num_batched_tokens {engine['max_num_batched_tokens']}, "
        f"{engine['num_blocks']} KV blocks of {engine['block_size']} tokens"
    )


def run(args) -> None:
    from jaxllm.engine.core import EngineCore
    from jaxllm.sim.calibrate import calibrate, calibrate_server, engine_description, kv_bytes_for
    from jaxllm.sim.progress import Progress

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.speculative_config is not None:
        raise ValueError(
            "calibrate times verification steps itself (drafts as extra rows) and replays its traces without "
            "speculation: leave out --speculative-config, and give it to `jaxllm simulate` instead"
        )
    say = Progress()
    given = [name for name in SHAPE_HELP if getattr(args, name) is not None]
    say.say(
        "loading the engine `jaxllm serve` would run with these flags "
        + (f"(given: {', '.join(given)}; the rest serve's defaults)" if given else "(serve's defaults)")
    )
    core = EngineCore(engine_args)
    say.say("calibrating " + coverage_line(engine_description(core)))
    model = calibrate(core, repeats=args.repeats, progress=say)
    if args.server:
        del core  # the server loads its own engine
        same_pool = dataclasses.replace(engine_args, kv_cache_memory_bytes=kv_bytes_for(model.engine))
        model = calibrate_server(model, same_pool.to_cli_args(), progress=say)
    model.save(args.out)
    fit = model.fit
    print(f"covers {coverage_line(model.engine)}")
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
    print(f"wrote {args.out} in {say.elapsed():.0f} s")


def event_costs(fit: dict, prefix: str) -> str:
    return (
        f"+{fit[prefix + '_idle_wake_s'] * 1e3:.1f} ms on the first step after idling, "
        f"+{fit[prefix + '_per_prefill_step_s'] * 1e3:.1f} ms per prefill step"
    )

"""`jaxllm calibrate --out cost.json`: time real compiled steps on this machine and fit the simulator's cost model."""

from __future__ import annotations

import argparse

from jaxllm.engine.args import EngineArgs

# the test suite's shapes: few buckets to compile (and JAX's cache usually has them), minutes in all
CALIBRATION_DEFAULTS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512}


def register(sub) -> None:
    parser = sub.add_parser("calibrate", help="fit the simulator's step-time model on this machine",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, metavar="FILE", help="the cost model JSON to write")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per sweep point (the fastest is kept)")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run, **CALIBRATION_DEFAULTS)


def run(args) -> None:
    from jaxllm.engine.core import EngineCore
    from jaxllm.sim.calibrate import calibrate

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    core = EngineCore(EngineArgs.from_cli_args(args))
    model = calibrate(core, repeats=args.repeats)
    model.save(args.out)
    fit = model.fit
    print(f"cost model ({model.form}) fitted on {fit['samples']} device steps: mean |error| "
          f"{fit['mean_abs_rel_error']:.1%}, p90 {fit['p90_abs_rel_error']:.1%}; on {fit['engine_steps']} engine steps: "
          f"mean {fit['engine_mean_abs_rel_error']:.1%}, total time {fit['engine_total_rel_error']:.1%}")
    print(f"wrote {args.out}")

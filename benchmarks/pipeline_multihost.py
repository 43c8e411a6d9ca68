#!/usr/bin/env python
"""Pipeline stages on two processes against one process: offline output tok/s of the default model.

Three setups, each its own processes, run one after another per round: one process with one device (PP=1); one
process with two stages on two host devices (PP=2, `jax.device_put` between them); two processes with a stage
each (`--nnodes 2 --pipeline-parallel-size 2`: node 0 broadcasts each step, hidden states and sampled ids cross
with jax.experimental.transfer). Each times `--batch` prompts of `--input-len` random tokens, `--output-len`
greedy tokens each, through `LLM.generate` after a warm-up; start-up is not timed.

    python benchmarks/pipeline_multihost.py --rounds 2 --out benchmarks/results/pipeline_multihost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def engine_kwargs(args) -> dict:
    return dict(max_num_seqs=args.batch, max_model_len=args.input_len + args.output_len, dtype="float32")


def measure(args, **settings) -> float:
    """In this process: output tok/s of one timed generate (node 0 of a multi-node run, or a single process)."""
    import numpy as np

    from jaxllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args), progress=False, **settings)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1000 + i, 2000 + i]} for i in range(4)], params, use_tqdm=False)
    rng = np.random.default_rng(args.seed)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, args.input_len).tolist()} for _ in range(args.batch)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def follow(args, **settings) -> None:
    from jaxllm.engine.args import EngineArgs
    from jaxllm.entrypoints.cli.common import run_headless

    run_headless(EngineArgs(**engine_kwargs(args), **settings))


def child(args) -> None:
    settings: dict = {}
    if args.setup == "pp2_one_process":
        settings = dict(pipeline_parallel_size=2)
    elif args.setup == "pp2_two_processes":
        settings = dict(pipeline_parallel_size=2, nnodes=2, node_rank=args.rank, master_port=args.port)
        if args.rank > 0:
            follow(args, **settings)
            return
    print(json.dumps({"tok_s": measure(args, **settings)}), flush=True)


def run_setup(args, setup: str, port: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    if setup == "pp2_one_process":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    base = [sys.executable, __file__, "--child", setup, "--port", str(port)]
    base += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("batch", "input_len", "output_len", "seed")]
    ranks = 2 if setup == "pp2_two_processes" else 1
    procs = [
        subprocess.Popen([*base, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True) for r in range(ranks)
    ]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{setup} failed")
    return json.loads(outs[0].strip().splitlines()[-1])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", dest="setup", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setup:
        child(args)
        return
    from jaxllm.bench.offline import machine_info
    from jaxllm.bench.server_process import free_port

    load_before = os.getloadavg()
    setups = ("pp1", "pp2_one_process", "pp2_two_processes")
    tok_s: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name in setups:
            tok_s[name].append(round(run_setup(args, name, free_port()), 1))
            print(name, tok_s[name][-1], file=sys.stderr)
    result = {
        "machine": {**machine_info(), "load_average_before": [round(x, 2) for x in load_before]},
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "settings": {k: v for k, v in vars(args).items() if k not in ("setup", "rank", "port")},
        "output_tok_s": tok_s,
        "summary": {
            name: {
                "median": round(statistics.median(ts), 1),
                "vs_pp1_per_round": [round(t / b, 2) for t, b in zip(ts, tok_s["pp1"], strict=True)],
            }
            for name, ts in tok_s.items()
        },
    }
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

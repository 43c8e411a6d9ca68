#!/usr/bin/env python
"""Pipeline parallelism on this machine: offline throughput at batch B with 1 stage, and with PP stages and 1..PP
batches in flight, on forced host devices; plus the activation copy between stages.

Every engine is built once and timed in interleaved rounds: `--batch` prompts of `--input-len` tokens, `--output-len`
greedy tokens each (EOS ignored), through `LLM.generate`. For the PP engine the number of batches in flight is
set by hand (the batch queue's depth, each batch's share of the rows) to show what overlap buys: with one in
flight the stages run one after another (the bubble is everything but one stage); with PP in flight they can
all be busy. The activation copy is what `StagedForward` does between stages: `jax.device_put` of the hidden
states (tokens x hidden size x 4 bytes) onto the next stage's device, timed alone.

Host "devices" share the same cores: on a CPU, stages cannot run truly side by side unless there are spare
cores, so this measures the mechanism's overhead and overlap here; with one accelerator per stage, a stage's
time is its share of the layers and the pipeline's throughput approaches PP x one stage's.

    XLA_FLAGS=--xla_force_host_platform_device_count=3 python benchmarks/pipeline.py --rounds 3 \
        --out benchmarks/results/pipeline_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=3")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm import LLM, SamplingParams  # noqa: E402
from jaxllm.bench.offline import machine_info  # noqa: E402


def set_in_flight(llm: LLM, batches: int, max_num_seqs: int) -> None:
    """The PP engine with `batches` in flight at most, each with its share of the rows."""
    llm.engine.loop.max_in_flight = batches
    llm.engine.scheduler.max_num_rows = -(-max_num_seqs // batches)


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    """Output tokens per second; the prefix cache is emptied first (every setup computes every prompt)."""
    llm.engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def activation_copy(hidden_size: int, tokens: int, reps: int = 20) -> dict:
    """Seconds to device_put [tokens, hidden] float32 from device 0 to device 1 (median of `reps`)."""
    devices = jax.devices()
    x = jax.device_put(np.ones((tokens, hidden_size), np.float32), devices[0])
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        jax.device_put(x, devices[1]).block_until_ready()
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    nbytes = tokens * hidden_size * 4
    return {"tokens": tokens, "bytes": nbytes, "seconds": seconds, "gb_s": round(nbytes / seconds / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--pp", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = dict(
        max_num_seqs=args.batch, max_model_len=args.input_len + args.output_len, dtype="float32", progress=False
    )
    load_before = os.getloadavg()
    one = LLM(**engine)
    staged = LLM(**engine, pipeline_parallel_size=args.pp)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    setups = {"pp1": (one, None)} | {f"pp{args.pp}_in_flight_{d}": (staged, d) for d in range(1, args.pp + 1)}
    for llm, depth in setups.values():  # warm-up
        if depth:
            set_in_flight(llm, depth, args.batch)
        run(llm, [{"prompt_token_ids": [1000 + i, 2000 + i]} for i in range(4)], params)
    tok_s: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        prompts = [{"prompt_token_ids": rng.integers(100, 40000, args.input_len).tolist()} for _ in range(args.batch)]
        for name, (llm, depth) in setups.items():
            if depth:
                set_in_flight(llm, depth, args.batch)
            tok_s[name].append(run(llm, prompts, params))
    hidden = one.engine.loaded.arch.hidden_size
    base = tok_s["pp1"]
    result = {
        "machine": {**machine_info(), "load_average_before": [round(x, 2) for x in load_before]},
        "devices": len(jax.devices()),
        "settings": vars(args),
        "layer_ranges": staged.engine.runner.ranges,
        "output_tok_s": {name: [round(t, 1) for t in ts] for name, ts in tok_s.items()},
        "summary": {
            name: {
                "output_tok_s_median": round(statistics.median(ts), 1),
                "vs_pp1_per_round": [round(t / b, 2) for t, b in zip(ts, base, strict=True)],
            }
            for name, ts in tok_s.items()
        },
        "activation_copy": [activation_copy(hidden, t) for t in (1, args.batch, 512)],
    }
    print(json.dumps(result["summary"], indent=2))
    print(json.dumps(result["activation_copy"], indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

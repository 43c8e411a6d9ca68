"""Chunked prefill vs whole-prompt prefill: p99 inter-token latency under mixed long/short load.

Echoes Sarathi-Serve (Agrawal et al., OSDI 2024): when a long prompt is prefilled in one step,
every running decode waits for that step ("generation stalls"), so the ITL tail explodes; splitting
prompts into chunks that share each step with the decodes bounds it. "Whole-prompt" here is the
same scheduler with a token budget that fits the longest prompt in one step (2048); "chunked" is a
64-token budget. Writes chunked_prefill.png (ITL CDFs) and prints p50/p99 ITL, TTFT and makespan.
"""

import json
from pathlib import Path

import numpy as np
from common import capacity, figure, parse_args, run, save

from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.synth import LengthDist, merge, synthesize


def main():
    args = parse_args(__doc__.splitlines()[0])
    cost = CostModel.load(args.cost)
    short_rate = 0.6 * capacity(cost, prompt_len=32, output_len=64)  # chats use 60 % of the engine
    long_rate = 0.15 * capacity(cost, prompt_len=1536, output_len=8)  # long prompts another 15 %
    short = synthesize(
        300,
        request_rate=short_rate,
        input_len=LengthDist(32, "uniform"),
        output_len=LengthDist(64, "uniform"),
        seed=args.seed,
    )
    long = synthesize(
        max(3, round(long_rate * short[-1].arrival_time)),
        request_rate=long_rate,
        input_len=LengthDist(1536, "uniform", range_ratio=0.2),
        output_len=LengthDist(8),
        start=short[-1].arrival_time * 0.1,
        seed=args.seed + 1,
    )
    trace = merge(short, long)
    fig, ax = figure(width=7.5)
    summary = {}
    for label, budget in (("chunked (64-token steps)", 64), ("whole prompts (2048-token steps)", 2048)):
        result = run(trace, cost, max_num_batched_tokens=budget, seed=args.seed)
        itl = np.sort([g * 1000 for r in result.records for g in r.itl])
        j = result.to_json(percentiles=(50, 99, 99.9))
        summary[label] = {
            **{
                k: j[k] for k in ("p50_itl_ms", "p99_itl_ms", "p99.9_itl_ms", "mean_ttft_ms", "p99_ttft_ms", "duration")
            },
            "max_itl_ms": float(itl.max()),
        }
        print(
            f"{label:34s} ITL p50 {j['p50_itl_ms']:6.0f}  p99 {j['p99_itl_ms']:6.0f}  p99.9 {j['p99.9_itl_ms']:6.0f}"
            f"  max {itl.max():6.0f} ms   TTFT mean {j['mean_ttft_ms']:6.0f} ms   makespan {j['duration']:5.0f} s"
        )
        ax.plot(
            itl,
            np.arange(1, itl.size + 1) / itl.size,
            label=f"{label}: p99 {j['p99_itl_ms']:.0f} ms, max {itl.max():.0f} ms",
        )
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.set_ylim(0.9, 1.001)  # the tail is the point
    ax.set_title("ITL tail: short chats + occasional 1.5k-token prompts")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    save(fig, Path(args.out) / "chunked_prefill.png")
    (Path(args.out) / "chunked_prefill.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()

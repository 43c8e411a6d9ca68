"""A sweep of `max_num_batched_tokens`: the TTFT / TPOT trade-off.

Echoes vLLM's chunked-prefill tuning guidance and Sarathi-Serve: a small token budget keeps every
step short (low TPOT/ITL for running decodes) but spreads prefills over many steps (higher TTFT);
a large one prefills in fewer, longer steps (lower TTFT, higher TPOT). Same trace at each budget.
Writes batched_tokens_sweep.png (mean TTFT and mean TPOT against the budget).
"""

import json
from pathlib import Path

from common import capacity, figure, parse_args, run, save

from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.synth import LengthDist, synthesize

BUDGETS = (16, 32, 64, 128, 256, 512)


def main():
    args = parse_args(__doc__.splitlines()[0])
    cost = CostModel.load(args.cost)
    rate = 0.8 * capacity(cost, prompt_len=384, output_len=64)
    trace = synthesize(
        300,
        request_rate=rate,
        input_len=LengthDist(384, "lognormal", sigma=0.8, maximum=1800),
        output_len=LengthDist(64, "uniform"),
        seed=args.seed,
    )
    rows = []
    for budget in BUDGETS:
        j = run(trace, cost, max_num_batched_tokens=budget, seed=args.seed).to_json()
        rows.append(
            {
                "max_num_batched_tokens": budget,
                **{
                    k: j[k]
                    for k in (
                        "mean_ttft_ms",
                        "p99_ttft_ms",
                        "mean_tpot_ms",
                        "p99_itl_ms",
                        "output_throughput",
                        "duration",
                    )
                },
            }
        )
        print(
            f"budget {budget:4d}: TTFT mean {j['mean_ttft_ms']:8.0f} ms  TPOT mean {j['mean_tpot_ms']:6.0f} ms"
            f"  ITL p99 {j['p99_itl_ms']:6.0f} ms  output {j['output_throughput']:5.1f} tok/s"
        )
    calibrated = max(cost.bucket_tokens)
    fig, ax = figure()
    ax.plot([r["mean_tpot_ms"] for r in rows], [r["mean_ttft_ms"] / 1000 for r in rows], "o-")
    for r in rows:
        note = "" if r["max_num_batched_tokens"] <= calibrated else " (extrapolated)"
        ax.annotate(
            f"{r['max_num_batched_tokens']}{note}",
            (r["mean_tpot_ms"], r["mean_ttft_ms"] / 1000),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=8,
        )
    ax.set_xlabel("mean TPOT (ms)")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("max_num_batched_tokens: TTFT vs TPOT")
    ax.grid(alpha=0.3)
    save(fig, Path(args.out) / "batched_tokens_sweep.png")
    (Path(args.out) / "batched_tokens_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

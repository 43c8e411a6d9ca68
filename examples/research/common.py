"""What the research scripts share: the cost model, a simulator config, one run, a results folder.

Every script runs the engine's own scheduler in the simulator (`jaxllm.sim`) on a cost model
calibrated on a real engine (`cost_cpu.json` here: `jaxllm calibrate` on a 2-core x86 CPU with the
default model at the test suite's shapes, max_model_len 512, 8 sequences, 64-token steps, not `jaxllm serve`'s
defaults, which `jaxllm calibrate` now takes; the scripts' larger shapes are extrapolated from it; pass `--cost`
for your own, e.g. calibrated on a GPU).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from jaxllm.config import SchedulerConfig
from jaxllm.sim.costmodel import CostModel, StepShape
from jaxllm.sim.simulator import SimConfig, SimResult, cost_model_step_time, simulate

HERE = Path(__file__).parent


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cost", default=str(HERE / "cost_cpu.json"), help="cost model from `jaxllm calibrate`")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for the PNG and JSON")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


def run(
    trace,
    cost: CostModel,
    *,
    policy: str = "fcfs",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 2048,
    num_blocks: int = 1024,
    prefix_caching: bool = True,
    seed: int = 0,
    oracle_output_len: bool = False,
) -> SimResult:
    config = SimConfig(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, policy),
        num_blocks=num_blocks,
        block_size=cost.engine.get("block_size", 16),
        enable_prefix_caching=prefix_caching,
    )
    return simulate(
        trace,
        config,
        cost_model_step_time(cost, config),
        seed=seed,
        oracle_output_len=oracle_output_len,
        **cost.event_costs(),
    )


def capacity(
    cost: CostModel, *, prompt_len: int, output_len: int, max_num_seqs: int = 16, max_num_batched_tokens: int = 64
) -> float:
    """Requests per second the engine sustains on this cost model (full decode batches plus the prefill
    steps), so a script can set its load as a fraction of it and stay meaningful on any calibration."""
    context = prompt_len + output_len // 2
    decode = cost.step_time(
        StepShape(max_num_seqs, max_num_seqs, max_num_seqs * context, max_num_seqs * context), max_num_batched_tokens
    )
    chunk = min(prompt_len, max_num_batched_tokens)
    prefill = cost.step_time(StepShape(chunk, 1, prompt_len, chunk * prompt_len), max_num_batched_tokens)
    seconds_per_request = decode * output_len / max_num_seqs + prefill * -(-prompt_len // chunk)
    return 1.0 / seconds_per_request


def ttfts_ms(result: SimResult, indices) -> np.ndarray:
    return np.array([result.records[i].ttft * 1000 for i in indices if result.records[i].success])


def figure(ncols: int = 1, width: float = 6.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, 4.2), layout="constrained")
    return fig, fig.subplots(1, ncols)


def save(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")

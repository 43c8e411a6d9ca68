"""PNG plots of `jaxllm bench throughput` / `jaxllm bench latency` results, jaxllm beside its peers.

matplotlib's object API on the Agg canvas, as `jaxllm.bench.plots` does: no pyplot state, no display.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from jaxllm.bench.plots import _save


def plot_throughput(result: dict, out_dir: str | Path) -> Path:
    """Output tokens/s per engine, one dot per round, the bar at the median."""
    rounds = result["rounds"]
    engines = ["jaxllm"] + [p for p, e in result.get("comparison", {}).items() if e["output_tokens_per_second"]]
    per_engine = [[r[e]["output_tokens_per_second"] for r in rounds if "error" not in r[e]] for e in engines]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(engines))
    ax.bar(x, [float(np.median(v)) for v in per_engine], color="tab:blue", alpha=0.6)
    for i, values in enumerate(per_engine):
        ax.plot([i] * len(values), values, "k.", markersize=6)
    ax.set_xticks(x, engines)
    ax.set_ylabel("output tokens/s")
    w = result["workload"]
    ax.set_title(f"{w['num_prompts']} prompts x {w['input_len']} in / {w['output_len']} out")
    return _save(fig, _folder(out_dir) / "throughput.png")


def plot_latencies(result: dict, out_dir: str | Path) -> Path:
    """Per-iteration batch latency of each engine (a box per engine)."""
    series = {"jaxllm": result["latencies"]}
    for peer, entry in result.get("comparison", {}).items():
        if "latencies" in entry:
            series[peer] = entry["latencies"]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.boxplot(list(series.values()), tick_labels=list(series))
    ax.set_ylabel("batch latency (s)")
    w = result["workload"]
    ax.set_title(f"batch {w['batch_size']}: {w['input_len']} in / {w['output_len']} out, {w['num_iters']} iterations")
    return _save(fig, _folder(out_dir) / "latency.png")


def _folder(out_dir: str | Path) -> Path:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path

"""The simulator's own plot: KV-cache usage (and preemptions) over the run. Latency and throughput
plots are `jaxllm.bench.plots`', shared with `jaxllm bench serve`."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from jaxllm.bench.plots import _save


def plot_kv_usage(sim, path: str | Path, title: str = "") -> Path:
    """Fraction of KV blocks in use after each step of a `SimResult`."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.subplots()
    ax.set_title(
        f"KV-cache usage over time{' — ' + title if title else ''} "
        f"({sim.num_preemptions} preemptions, prefix-cache hit rate {sim.prefix_cache_hit_rate:.0%})"
    )
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("blocks in use")
    ax.grid(alpha=0.3)
    ax.plot([t for t, _ in sim.kv_usage], [u for _, u in sim.kv_usage], linewidth=0.8)
    ax.set_ylim(0, 1.02)
    return _save(fig, Path(path))

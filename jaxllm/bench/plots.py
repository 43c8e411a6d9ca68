"""PNG plots of a serving run from its per-request records, measured (`jaxllm bench serve --plot`) or
simulated (`jaxllm simulate`): latency CDFs and output throughput over time.

Figures are built with matplotlib's object API on the Agg canvas: no pyplot state, no display.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxllm.bench.results import RequestRecord

_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def _samples(records: list[RequestRecord]) -> dict[str, np.ndarray]:
    done = [r for r in records if r.success]
    values = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done if r.latency is not None],
    }
    return {k: np.sort(np.asarray(v, dtype=np.float64)) * 1000.0 for k, v in values.items()}


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def plot_latency_cdfs(records: list[RequestRecord], path: str | Path, title: str = "") -> Path:
    """One CDF panel per metric (ms), with the median and p99 marked."""
    fig = Figure(figsize=(10, 7), layout="constrained")
    fig.suptitle(title or "Latency CDFs")
    for ax, (name, ms) in zip(fig.subplots(2, 2).flat, _samples(records).items(), strict=True):
        ax.set_title(_LABELS[name])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if not ms.size:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
        for q, style in ((50, "--"), (99, ":")):
            value = np.percentile(ms, q)
            ax.axvline(value, color="gray", linestyle=style, label=f"p{q} {value:.1f} ms")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right")
    return _save(fig, Path(path))


def plot_throughput(
    records: list[RequestRecord], path: str | Path, title: str = "", bin_s: float | None = None
) -> Path:
    """Output tokens/s in `bin_s` bins (default: about 60 bins over the run, at least 0.1 s) and
    requests in flight, over the run."""
    done = [r for r in records if r.success]
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.set_title(title or "Output throughput over time")
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    if not done:
        ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
        return _save(fig, Path(path))
    t0 = min(r.start for r in done)
    times = np.asarray([t for r in done for t in r.token_times]) - t0
    bin_s = bin_s or max(float(times.max()) / 60, 0.1)
    counts, edges = np.histogram(times, bins=np.arange(0.0, times.max() + 2 * bin_s, bin_s))
    ax.stairs(counts / bin_s, edges, fill=True, alpha=0.6, label=f"output tokens/s ({bin_s:.2g} s bins)")
    spans = [(r.start - t0, r.start + r.latency - t0) for r in done if r.latency is not None]
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    in_flight = ax.twinx()
    in_flight.step(
        [t for t, _ in events],
        np.cumsum([d for _, d in events]),
        where="post",
        color="tab:red",
        label="requests in flight",
    )
    in_flight.set_ylabel("requests in flight")
    in_flight.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + in_flight.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right")
    return _save(fig, Path(path))


def save_plots(result: dict, records: list[RequestRecord], out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Both plots into `out_dir` (created), titled from the result; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rate = result.get("request_rate")
    title = ", ".join(
        part
        for part in (
            result.get("model_id"),
            f"{rate} req/s" if rate is not None else None,
            f"{result['completed']} completed, {result['failed']} failed",
        )
        if part
    )
    return [
        plot_latency_cdfs(records, out / f"{prefix}latency_cdf.png", title),
        plot_throughput(records, out / f"{prefix}throughput.png", title),
    ]

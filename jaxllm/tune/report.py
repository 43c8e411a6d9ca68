"""The tuning report: the JSON (`--output`, written whole or not at all), the table printed, the `jaxllm serve`
command of the best setting, the error when no setting meets the SLOs, and `--plot` PNGs (each setting's
sustainable rate; the TTFT/TPOT trade-off)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import tempfile
from pathlib import Path

from jaxllm.engine.args import EngineArgs
from jaxllm.tune.search import Candidate


def engine_args_dict(args: EngineArgs) -> dict:
    """The engine arguments that differ from EngineArgs' defaults (what `to_cli_args` writes as flags)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if getattr(args, f.name) != f.default}


def serve_command(args: EngineArgs) -> str:
    return shlex.join(["jaxllm", "serve", *args.to_cli_args()])


def router_command(instances: int, router: str) -> str:
    """`jaxllm router` in front of the instances (their URLs are the user's to fill in): N equal instances under a
    policy, or "pd P:D" prefill and decode instances (each started with its TransferConnector role)."""
    urls = [f"http://HOST{k}:8000" for k in range(1, instances + 1)]
    if router.startswith("pd "):
        from jaxllm.sim.pd import parse_pd

        p, _ = parse_pd(router.removeprefix("pd "))
        return shlex.join(["jaxllm", "router", "--prefill", *urls[:p], "--decode", *urls[p:]])
    return shlex.join(["jaxllm", "router", "--instances", *urls, "--policy", router])


def candidate_json(c: Candidate) -> dict:
    at = c.capacity.at_trace
    return {
        "setting": c.setting,
        "engine_args": engine_args_dict(c.args),
        "max_request_rate": c.max_request_rate,
        # set when the search stopped early (the setting could not reach the best): the rate lies in
        # [max_request_rate, max_request_rate_below)
        "max_request_rate_below": c.capacity.below,
        "goodput_fraction": at.fraction,  # on the trace as given
        "slo_attainment": at.misses,  # per SLO: the metric at the goodput fraction's quantile / the SLO
        "simulations": c.capacity.simulations,
        "predicted": at.summary,
    }


def short(setting: dict) -> str:
    abbrev = {"max_num_seqs": "seqs", "max_num_batched_tokens": "tokens", "scheduling_policy": "policy"}
    return " ".join(f"{abbrev.get(k, k)}={v}" for k, v in setting.items())


def rate(c: Candidate) -> str:
    return f"<{c.capacity.below:.2f}" if c.capacity.below is not None else f"{c.max_request_rate:.2f}"


def table(candidates: list[Candidate], slos: dict[str, float], limit: int = 15) -> str:
    """The best `limit` candidates, one line each."""
    head = f"{'setting':<40} {'max req/s':>9} {'goodput':>8} {'TTFT ms':>8} {'TPOT ms':>8} {'E2EL ms':>8}"
    lines = [head, "-" * len(head)]
    for c in candidates[:limit]:
        s = c.capacity.at_trace.summary
        lines.append(
            f"{short(c.setting):<40} {rate(c):>9} {c.capacity.at_trace.fraction:>8.1%} "
            f"{s['mean_ttft_ms']:>8.1f} {s['mean_tpot_ms']:>8.1f} {s['mean_e2el_ms']:>8.1f}"
        )
    if len(candidates) > limit:
        lines.append(f"... {len(candidates) - limit} more in the JSON")
    lines.append(
        "(max req/s: the highest sustainable rate, <R where the search stopped once the setting could not reach the "
        "best; the rest predicted on the trace as given)"
    )
    return "\n".join(lines)


def validation_table(rows: list[dict]) -> str:
    """Predicted and measured side by side, the error as measured vs predicted ((m - p) / p), and per setting
    one line in words for the means."""
    lines = [f"{'setting':<40} {'metric':<18} {'predicted':>10} {'measured':>10} {'measured vs predicted':>22}"]
    for row in rows:
        for key, v in row["compared"].items():
            error = f"{v['relative_error']:+.0%}" if v["relative_error"] is not None else "-"
            fmt = ".1%" if key == "goodput_fraction" else ".2f"
            lines.append(
                f"{short(row['setting']):<40} {key:<18} {v['predicted']:>10{fmt}} {v['measured']:>10{fmt}} {error:>22}"
            )
    for row in rows:
        means = [
            versus(key, row["compared"][key]) for key in ("mean_ttft_ms", "mean_tpot_ms") if key in row["compared"]
        ]
        lines.append(f"{short(row['setting'])}: " + ", ".join(means))
    return "\n".join(lines)


def versus(key: str, compared: dict) -> str:
    """`measured TTFT 5.3 s vs predicted 129 ms (+4000%)` for a `side_by_side` row of a *_ms key."""
    name = key.removesuffix("_ms").replace("_", " ").replace("ttft", "TTFT").replace("tpot", "TPOT")
    error = compared["relative_error"]
    sign = f" ({error:+.0%})" if error is not None else ""
    return f"measured {name} {duration(compared['measured'])} vs predicted {duration(compared['predicted'])}{sign}"


def duration(ms: float) -> str:
    """Milliseconds for a reader: `129 ms`, `5.3 s`."""
    return f"{ms / 1000:.1f} s" if abs(ms) >= 1000 else f"{ms:.3g} ms"


def unmeetable(candidates: list[Candidate], lowest_rate: float, fraction: float) -> str:
    """No setting meets the SLOs at any rate: the closest one and by how much it misses, at the lowest rate."""

    def worst(c: Candidate) -> float:
        misses = c.capacity.lowest.misses
        return float("inf") if misses.get("failed") else max(v for k, v in misses.items() if k != "failed")

    closest = min(candidates, key=lambda c: (worst(c), c.rank_key()))
    lowest = closest.capacity.lowest
    q = f"p{100 * fraction:g}"
    misses = ", ".join(
        f"{q} {k.upper()} {v:.2f}x its SLO ({v - 1:+.0%})" for k, v in lowest.misses.items() if k != "failed" and v > 1
    )
    failed = lowest.misses.get("failed")
    return (
        f"no setting meets the SLOs for {fraction:.0%} of the requests at any rate tried (down to "
        f"{lowest_rate:.4g} req/s, each request nearly alone); the closest, {short(closest.setting)}, serves "
        f"{lowest.fraction:.1%} of them within every SLO: {misses or 'within the SLOs at the quantile'}"
        + (f"; {failed:g} requests failed" if failed else "")
    )


def write_json(result: dict, path: str | Path) -> None:
    """Atomically: a temporary file beside it, renamed into place (no partial file on an error)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_plots(candidates: list[Candidate], slos: dict[str, float], directory: str | Path) -> list[Path]:
    """max_request_rate.png (each setting's sustainable rate, best first) and latency_tradeoff.png (p99 TTFT
    against p99 TPOT on the trace as given, coloured by sustainable rate, the SLOs drawn)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    shown = candidates[:40]
    fig = Figure(figsize=(9, 0.9 + 0.28 * len(shown)), layout="constrained")
    ax = fig.add_subplot()
    labels = [short(c.setting) for c in shown][::-1]
    rates = [c.max_request_rate for c in shown][::-1]
    bounds = [c.capacity.below or 0.0 for c in shown][::-1]
    ax.barh(range(len(shown)), bounds, color="lightgray", hatch="//", label="pruned: the rate is below this")
    bars = ax.barh(range(len(shown)), rates, color="tab:blue", label="sustainable rate (pruned: a lower bound)")
    bars[-1].set_color("tab:orange")  # the best
    ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(shown)), labels, fontsize=8)
    ax.set_xlabel("highest sustainable request rate (req/s, simulated)")
    ax.set_title(f"Sustainable rate per setting ({len(candidates)} tried; best in orange)")
    FigureCanvasAgg(fig)
    paths.append(out / "max_request_rate.png")
    fig.savefig(paths[-1], dpi=110)

    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    xs = [c.capacity.at_trace.summary["p99_tpot_ms"] for c in candidates]
    ys = [c.capacity.at_trace.summary["p99_ttft_ms"] for c in candidates]
    points = ax.scatter(xs, ys, c=[c.max_request_rate for c in candidates], cmap="viridis")
    ax.scatter(xs[:1], ys[:1], s=160, facecolors="none", edgecolors="tab:orange", label="best")
    fig.colorbar(points, ax=ax, label="sustainable rate (req/s)")
    if "tpot" in slos:
        ax.axvline(slos["tpot"], color="tab:red", linestyle="--", label="TPOT SLO")
    if "ttft" in slos:
        ax.axhline(slos["ttft"], color="tab:red", linestyle=":", label="TTFT SLO")
    ax.set_xlabel("p99 TPOT (ms)")
    ax.set_yscale("log")
    ax.set_ylabel("p99 TTFT (ms, log)")
    ax.set_title("Latency trade-off on the trace as given (simulated)")
    ax.legend()
    FigureCanvasAgg(fig)
    paths.append(out / "latency_tradeoff.png")
    fig.savefig(paths[-1], dpi=110)
    return paths

"""`--validate K`: serve the top K settings for real (`jaxllm serve` in a child process, `ServerProcess`) and
replay the trace at its own arrival times with `jaxllm bench serve`'s client; predicted and measured side by
side. The measured figure picks the winner: the goodput fraction, then request goodput, then mean E2E latency."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import ExitStack

from jaxllm.sim.trace import TraceRequest
from jaxllm.tune.search import Candidate

logger = logging.getLogger(__name__)

WARMUP_REQUESTS = 2  # served before the measured replay
# the keys compared, predicted against measured
COMPARED = ("goodput_fraction", "request_goodput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


def goodput_fraction(summary: dict, num_requests: int) -> float:
    """Requests within every SLO over all requests (`summarize`'s request_goodput x its duration)."""
    return round(summary["request_goodput"] * summary["duration"]) / num_requests


def replay(
    url: str,
    trace: list[TraceRequest],
    slos: dict[str, float],
    *,
    seed: int = 0,
    warm_up: bool = True,
    progress: bool = False,
) -> dict:
    """Replay the trace against a running server at its own arrival times (`jaxllm bench serve`'s client), after
    `WARMUP_REQUESTS` warm-up requests one at a time with other made-up tokens (no prefix-cache hits later); the
    measured bench-serve keys and the goodput fraction."""
    from jaxllm.bench.results import summarize
    from jaxllm.bench.serve import ENDPOINT, first_model, run

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    model = first_model(url, {})
    if warm_up:
        warm = [dataclasses.replace(r, arrival_time=0.0) for r in trace[:WARMUP_REQUESTS]]
        for i, request in enumerate(warm):
            asyncio.run(run([request], url=url + ENDPOINT, model=model, headers={}, seed=seed + 1 + i))
    records, duration = asyncio.run(
        run(trace, url=url + ENDPOINT, model=model, headers={}, seed=seed, progress=progress)
    )
    failed = [r.error for r in records if not r.success]
    if failed:
        logger.warning("replay on %s: %d requests failed (first: %s)", url, len(failed), failed[0])
    summary = summarize(records, duration, goodput=slos)
    summary["goodput_fraction"] = goodput_fraction(summary, len(trace))
    return summary


def measure(
    candidate: Candidate,
    trace: list[TraceRequest],
    slos: dict[str, float],
    *,
    seed: int = 0,
    startup_timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> dict:
    """Serve the candidate's engine arguments and replay the trace; the measured bench-serve keys. The server's
    start ticks on stderr with its log's last line, and the replay has a bar (neither is silent for long)."""
    from jaxllm.bench.server_process import ServerProcess
    from jaxllm.sim.progress import Progress, last_line

    flags = candidate.args.to_cli_args()
    say = Progress(command="tune")
    server = ServerProcess(flags, startup_timeout=startup_timeout, env=env)
    say.say(f"serving {' '.join(flags)} (its log: {server.log_path})")
    started = time.perf_counter()
    with ExitStack() as stack:
        with say.waiting("Starting jaxllm serve", last_line(server.log_path)):
            stack.enter_context(server)
        startup = time.perf_counter() - started
        say.say(f"server up in {startup:.0f} s; replaying {len(trace)} requests")
        summary = replay(server.url, trace, slos, seed=seed, progress=True)
    summary["server_startup_s"] = startup
    return summary


def side_by_side(predicted: dict, measured: dict) -> dict:
    """Per compared key: predicted, measured, and the prediction's error as a reader expects it, (measured -
    predicted) / predicted: +4000 % when the server took 41x the predicted time."""
    rows = {}
    for key in COMPARED:
        p, m = predicted[key], measured[key]
        rows[key] = {"predicted": p, "measured": m, "relative_error": (m - p) / p if p else None}
    return rows


def validate(
    candidates: list[Candidate],
    trace: list[TraceRequest],
    slos: dict[str, float],
    k: int,
    *,
    seed: int = 0,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """The top `k` candidates served for real, in their predicted order; each row's `measured` summary."""
    rows = []
    for rank, candidate in enumerate(candidates[:k]):
        logger.info("validating %d/%d: %s", rank + 1, min(k, len(candidates)), candidate.setting)
        measured = measure(candidate, trace, slos, seed=seed, env=env)
        predicted = {**candidate.capacity.at_trace.summary, "goodput_fraction": candidate.capacity.at_trace.fraction}
        rows.append(
            {
                "setting": candidate.setting,
                "predicted_rank": rank,
                "max_request_rate": candidate.max_request_rate,
                "compared": side_by_side(predicted, measured),
                "measured": measured,
            }
        )
    return rows


def measured_winner(rows: list[dict]) -> int:
    """The index of the best row by the measured figures."""
    return min(
        range(len(rows)),
        key=lambda i: (
            -rows[i]["measured"]["goodput_fraction"],
            -rows[i]["measured"]["request_goodput"],
            rows[i]["measured"]["mean_e2el_ms"],
            i,
        ),
    )

"""Serving-benchmark results with vLLM's definitions and JSON keys, shared by `jaxllm bench serve`
(measured) and `jaxllm simulate` (virtual clock).

Per request: TTFT (arrival → first token), ITL (gaps between consecutive tokens), TPOT
((E2E − TTFT) / (output tokens − 1), requests with more than one token), E2EL (arrival → last token).
Times in seconds in, milliseconds out. Goodput counts requests within every given SLO.
`per_request` / `records_from_result` carry the records through the result JSON (vLLM's arrays),
so plots and later analysis work from a saved file alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int = 0  # tokens received
    start: float = 0.0  # when the request was sent (or arrived), seconds on the run's clock
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None  # E2E
    success: bool = False
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def token_times(self) -> list[float]:
        """When each token arrived, on the run's clock (first token, then one per ITL gap)."""
        if self.ttft is None:
            return []
        return list(self.start + self.ttft + np.cumsum([0.0, *self.itl]))


def _stats(prefix: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {
        f"mean_{prefix}_ms": float(ms.mean()),
        f"median_{prefix}_ms": float(np.median(ms)),
        f"std_{prefix}_ms": float(ms.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{prefix}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(
    records: list[RequestRecord],
    duration: float,
    *,
    goodput: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (99,),
) -> dict:
    """The result dict (vLLM's keys). `goodput` maps "ttft"/"tpot"/"e2el" to an SLO in ms."""
    done = [r for r in records if r.success]
    output_tokens = sum(r.output_len for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    duration = max(duration, 1e-9)
    result = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if goodput:
        unknown = set(goodput) - {"ttft", "tpot", "e2el"}
        if unknown:
            raise ValueError(f"goodput SLOs are ttft, tpot and e2el (ms); got {sorted(unknown)}")
        good = sum(
            1
            for r in done
            if all(
                (v := {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}[k]) is None or v * 1000.0 <= slo
                for k, slo in goodput.items()
            )
        )
        result["request_goodput"] = good / duration
    samples = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done if r.latency is not None],
    }
    for name in METRICS:
        result.update(_stats(name, samples[name], percentiles))
    result.update(_peaks(done))
    return result


def _peaks(done: list[RequestRecord]) -> dict:
    """vLLM's peaks: the most output tokens in one whole second of the run, and the most requests
    in flight at once (half-open [start, end) intervals: a request ending as another starts is not overlap)."""
    times = np.asarray([t for r in done for t in r.token_times])
    if not times.size:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    per_second = np.bincount((times - min(r.start for r in done)).astype(int))
    spans = [(r.start, r.start + r.latency) for r in done if r.latency is not None]
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    return {
        "max_output_tokens_per_s": float(per_second.max()),
        "max_concurrent_requests": int(np.max(np.cumsum([delta for _, delta in events]))),
    }


def per_request(records: list[RequestRecord]) -> dict:
    """The records as vLLM's per-request arrays (seconds; None where a request never got that far)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len for r in records],
        "start_times": [r.start for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "latencies": [r.latency for r in records],
        "errors": [r.error or "" for r in records],
    }


def records_from_result(result: dict) -> list[RequestRecord]:
    """Records back from a result JSON that has `per_request`'s arrays."""
    return [
        RequestRecord(
            prompt_len=p, output_len=o, start=s, ttft=t, itl=list(i), latency=lat, success=not e, error=e or None
        )
        for p, o, s, t, i, lat, e in zip(
            result["input_lens"],
            result["output_lens"],
            result["start_times"],
            result["ttfts"],
            result["itls"],
            result["latencies"],
            result["errors"],
            strict=True,
        )
    ]


_HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def format_result(result: dict, metrics: tuple[str, ...] = METRICS, title: str = "Serving Benchmark Result") -> str:
    """The summary table vLLM prints, from a result dict (rows for keys it lacks are left out)."""
    rows = [
        ("Successful requests:", "completed", "d"),
        ("Failed requests:", "failed", "d"),
        ("Maximum request concurrency:", "max_concurrency", "d"),
        ("Benchmark duration (s):", "duration", ".2f"),
        ("Total input tokens:", "total_input_tokens", "d"),
        ("Total generated tokens:", "total_output_tokens", "d"),
        ("Request throughput (req/s):", "request_throughput", ".2f"),
        ("Request goodput (req/s):", "request_goodput", ".2f"),
        ("Output token throughput (tok/s):", "output_throughput", ".2f"),
        ("Peak output token throughput (tok/s):", "max_output_tokens_per_s", ".2f"),
        ("Peak concurrent requests:", "max_concurrent_requests", "d"),
        ("Total token throughput (tok/s):", "total_token_throughput", ".2f"),
    ]
    lines = [f"{' ' + title + ' ':=^50}"]
    lines += [f"{label:<40} {result[key]:<10{fmt}}" for label, key, fmt in rows if result.get(key) is not None]
    for name in metrics:
        lines.append(f"{_HEADERS[name]:-^50}")
        upper = name.upper()
        lines.append(f"{'Mean ' + upper + ' (ms):':<40} {result[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{'Median ' + upper + ' (ms):':<40} {result[f'median_{name}_ms']:<10.2f}")
        for key in result:
            if percentile := re.fullmatch(rf"p([\d.]+)_{name}_ms", key):
                lines.append(f"{f'P{percentile[1]} {upper} (ms):':<40} {result[key]:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)

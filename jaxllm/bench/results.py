"""Serving-benchmark results with vLLM's definitions and JSON keys, shared by `jaxllm bench serve`
(measured) and `jaxllm simulate` (virtual clock).

Per request: TTFT (arrival → first token), ITL (gaps between consecutive tokens), TPOT
((E2E − TTFT) / (output tokens − 1), requests with more than one token), E2EL (arrival → last token).
Times in seconds in, milliseconds out. Goodput counts requests within every given SLO.
"""

from __future__ import annotations

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


def _stats(prefix: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
           f"std_{prefix}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{prefix}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(records: list[RequestRecord], duration: float, *, goodput: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = (99,)) -> dict:
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
        good = sum(1 for r in done if all(
            (v := {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}[k]) is None or v * 1000.0 <= slo
            for k, slo in goodput.items()))
        result["request_goodput"] = good / duration
    samples = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done if r.latency is not None],
    }
    for name in METRICS:
        result.update(_stats(name, samples[name], percentiles))
    return result

"""From each step's cumulative `RequestOutput`s to the numbers the metrics report (vLLM's definitions).

- prompt tokens are counted when a request gets its first token; generation tokens as they arrive;
- time to first token = first token − arrival; inter-token latency = gap between a request's
  consecutive steps that gave it tokens;
- for a finished request: end-to-end = finish − arrival, queue = first scheduled − arrival,
  prefill = first token − first scheduled, decode = finish − first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.outputs import RequestOutput


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one batch of outputs (one engine step) adds."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class OutputStatsTracker:
    """Remembers, per unfinished request, how many tokens it had and when its last ones came."""

    def __init__(self):
        self._seen: dict[str, tuple[int, float | None]] = {}  # request id → (tokens so far, time of the last)

    def observe(self, outputs: list[RequestOutput], now: float) -> IterationStats:
        stats = IterationStats()
        for out in outputs:
            tokens = sum(len(c.token_ids) for c in out.outputs)
            before, last_time = self._seen.get(out.request_id, (0, None))
            new = tokens - before
            if new > 0:
                stats.num_generation_tokens += new
                if last_time is None:
                    stats.num_prompt_tokens += len(out.prompt_token_ids)
                    if out.metrics is not None:
                        stats.time_to_first_tokens.append(now - out.metrics.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - last_time)
                last_time = now
            if out.finished:
                self._seen.pop(out.request_id, None)
                stats.finished.append(_finished(out, tokens, now))
            else:
                self._seen[out.request_id] = (tokens, last_time)
        return stats


def _finished(out: RequestOutput, tokens: int, now: float) -> FinishedRequestStats:
    m = out.metrics
    reason = out.outputs[0].finish_reason if out.outputs else "error"
    if m is None:  # refused before it reached the engine
        return FinishedRequestStats(reason or "error", 0.0, 0.0, 0.0, 0.0, len(out.prompt_token_ids), tokens)
    finished = m.finished_time or now
    scheduled = m.first_scheduled_time or finished
    first_token = m.first_token_time or finished
    return FinishedRequestStats(
        finish_reason=reason or "error",
        e2e_latency=finished - m.arrival_time,
        queue_time=scheduled - m.arrival_time,
        prefill_time=first_token - scheduled,
        decode_time=finished - first_token,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_generation_tokens=tokens,
    )

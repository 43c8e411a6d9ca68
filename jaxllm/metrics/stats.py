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


def spec_decode_summary(totals: dict, before: dict | None = None) -> dict | None:
    """Speculation over an interval, from two `EngineCore.stats()` snapshots (running totals; `before` None: since
    start), or None when the engine does not speculate. vLLM's definitions: acceptance rate = accepted / draft
    tokens, mean acceptance length = 1 + accepted / drafts (the tokens a verification yields, the target's own
    included), per-position acceptance rate = accepted at position j / drafts. A rate with nothing to divide is
    None."""
    if "spec_decode_num_drafts" not in totals:
        return None
    before = before or {}

    def delta(key: str) -> int:
        return totals.get(key, 0) - before.get(key, 0)

    drafts, draft_tokens, accepted = (
        delta(f"spec_decode_num_{k}") for k in ("drafts", "draft_tokens", "accepted_tokens")
    )
    per_pos_now = totals.get("spec_decode_num_accepted_tokens_per_pos", [])
    per_pos_before = before.get("spec_decode_num_accepted_tokens_per_pos", [])
    per_pos = [n - (per_pos_before[j] if j < len(per_pos_before) else 0) for j, n in enumerate(per_pos_now)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "num_unspeculated": delta("spec_decode_num_unspeculated"),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance_rate": [n / drafts for n in per_pos] if drafts else None,
    }


def sum_engine_stats(per_engine: list[dict]) -> dict:
    """Data-parallel replicas' running totals added up (numbers summed, lists position by position); gauges such
    as `kv_cache_usage` come out summed too, so read only counts from it."""
    total: dict = {}
    for stats in per_engine:
        for key, value in stats.items():
            if isinstance(value, list):
                old = total.get(key, [])
                n = max(len(old), len(value))
                total[key] = [(old[j] if j < len(old) else 0) + (value[j] if j < len(value) else 0) for j in range(n)]
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total

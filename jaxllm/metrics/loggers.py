"""The periodic stats line, like vLLM's: throughput since the last line, queue sizes, KV usage, prefix hits, and
with speculation its acceptance rate and mean acceptance length over the same interval."""

from __future__ import annotations

import logging
import time

from jaxllm.metrics.stats import IterationStats, spec_decode_summary

logger = logging.getLogger("jaxllm")

LOG_INTERVAL_S = 10.0


class LoggingStatLogger:
    """Accumulates one engine core's tokens; `log(now)` writes a line when there was anything to say."""

    def __init__(self, engine_index: int = 0):
        self.engine_index = engine_index
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_log = time.monotonic()
        self._prefix = (0, 0)  # (queries, hits) at the last line
        self._stats: dict | None = None
        self._spec_totals: dict | None = None  # the speculation totals at the last line

    def record_engine(self, stats: dict) -> None:
        self._stats = stats

    def record_iteration(self, it: IterationStats) -> None:
        self._prompt_tokens += it.num_prompt_tokens
        self._generation_tokens += it.num_generation_tokens

    def log(self, now: float) -> str | None:
        """Log (and return) the line for the interval since the previous call; None when idle throughout."""
        last, self._last_log = self._last_log, now
        s = self._stats
        if s is None:
            return None
        busy = self._prompt_tokens or self._generation_tokens or s["num_running"] or s["num_waiting"]
        if not busy:
            return None
        elapsed = max(now - last, 1e-9)
        queries = s["prefix_cache_queries"] - self._prefix[0]
        hits = s["prefix_cache_hits"] - self._prefix[1]
        self._prefix = (s["prefix_cache_queries"], s["prefix_cache_hits"])
        line = (
            f"Engine {self.engine_index:03d}: "
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {s['num_running']} reqs, Waiting: {s['num_waiting']} reqs, "
            f"KV cache usage: {100 * s['kv_cache_usage']:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        if (spec := spec_decode_summary(s, self._spec_totals)) is not None:
            self._spec_totals = s
            line += ", " + format_spec_decode(spec)
        self._prompt_tokens = self._generation_tokens = 0
        logger.info(line)
        return line


def format_spec_decode(spec: dict) -> str:
    """Speculation over an interval (`spec_decode_summary`) in words, as vLLM's SpecDecoding line says it."""
    if not spec["num_drafts"]:
        return "Spec decode: no drafts"
    per_pos = ", ".join(f"{r:.2f}" for r in spec["per_position_acceptance_rate"])
    return (
        f"Spec decode: acceptance rate {100 * spec['acceptance_rate']:.1f}%, "
        f"mean acceptance length {spec['mean_acceptance_length']:.2f}, "
        f"accepted {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens, "
        f"per-position acceptance {per_pos}"
    )

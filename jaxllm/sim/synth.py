"""Synthetic request traces (`jaxllm trace synth`): arrivals, length distributions, tenants, shared prefixes.

Arrivals follow vLLM's benchmark convention: gaps drawn from a gamma distribution with shape
`burstiness` and mean 1/rate, so burstiness 1 is a Poisson process and smaller values are
burstier (same mean rate, more clumping). Every draw comes from one seeded generator, so a
seed fixes the trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jaxllm.sim.trace import TraceRequest

DISTRIBUTIONS = ("fixed", "uniform", "exponential", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """Token lengths with the given mean, clipped to [minimum, maximum].

    fixed: always `mean`; uniform: in mean·[1 − range_ratio, 1 + range_ratio] (vLLM's random
    dataset); exponential; lognormal with log-space spread `sigma` (long-tailed, like chat traces).
    """

    mean: int
    kind: str = "fixed"
    range_ratio: float = 0.5
    sigma: float = 1.0
    minimum: int = 1
    maximum: int | None = None

    def __post_init__(self):
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"length distribution {self.kind!r} is not one of {', '.join(DISTRIBUTIONS)}")
        if self.mean < 1:
            raise ValueError(f"a mean length must be >= 1, got {self.mean}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            values = np.full(n, float(self.mean))
        elif self.kind == "uniform":
            values = rng.uniform(self.mean * (1 - self.range_ratio), self.mean * (1 + self.range_ratio), n)
        elif self.kind == "exponential":
            values = rng.exponential(self.mean, n)
        else:  # lognormal with this mean: mu = ln(mean) - sigma^2 / 2
            values = rng.lognormal(math.log(self.mean) - self.sigma**2 / 2, self.sigma, n)
        return np.clip(np.rint(values), self.minimum, self.maximum or np.inf).astype(int)


def arrival_times(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times (s) of `n` requests at `rate` per second; rate inf: all at time 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate} and {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps)


def synthesize(
    num_requests: int,
    *,
    request_rate: float,
    input_len: LengthDist,
    output_len: LengthDist,
    burstiness: float = 1.0,
    num_prefix_groups: int = 0,
    prefix_len: int = 0,
    num_users: int = 0,
    user_skew: float = 0.0,
    num_priorities: int = 1,
    acceptance_rate: float | tuple[float, float] | None = None,
    start: float = 0.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """A trace of `num_requests` made-up requests.

    With prefix groups, each request joins one group (uniformly) and its prompt is the group's
    `prefix_len` shared tokens followed by `input_len` tokens of its own. Users are drawn with
    Zipf-like weights 1/(k+1)^user_skew (0: uniform); priorities uniformly from 0..num_priorities-1.
    `acceptance_rate` (speculative decoding, for `jaxllm simulate`): every request's, or a (low, high)
    range each request's is drawn from uniformly (after every other draw: the rest of the trace is the
    same with or without it).
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if num_prefix_groups and prefix_len < 1:
        raise ValueError("prefix groups need prefix_len >= 1")
    rng = np.random.default_rng(seed)
    arrivals = start + arrival_times(rng, num_requests, request_rate, burstiness)
    inputs = input_len.sample(rng, num_requests)
    outputs = output_len.sample(rng, num_requests)
    groups = rng.integers(num_prefix_groups, size=num_requests) if num_prefix_groups else None
    users = None
    if num_users:
        weights = 1.0 / np.arange(1, num_users + 1) ** user_skew
        users = rng.choice(num_users, size=num_requests, p=weights / weights.sum())
    priorities = rng.integers(num_priorities, size=num_requests) if num_priorities > 1 else None
    rates: list[float | None]
    if isinstance(acceptance_rate, tuple):
        low, high = acceptance_rate
        if not 0 <= low <= high <= 1:
            raise ValueError(f"an acceptance-rate range needs 0 <= low <= high <= 1, got {acceptance_rate}")
        rates = [round(float(r), 4) for r in rng.uniform(low, high, num_requests)]  # short in the JSON
    else:
        rates = [acceptance_rate] * num_requests
    trace = []
    for i in range(num_requests):
        shared = prefix_len if groups is not None else 0
        trace.append(
            TraceRequest(
                arrival_time=round(float(arrivals[i]), 6),
                output_len=int(outputs[i]),
                prompt_len=int(inputs[i]) + shared,
                priority=int(priorities[i]) if priorities is not None else 0,
                user=f"user-{users[i]}" if users is not None else None,
                prefix_group=f"g{groups[i]}" if groups is not None else None,
                prefix_len=shared,
                acceptance_rate=rates[i],
            )
        )
    return trace


def merge(*traces: list[TraceRequest]) -> list[TraceRequest]:
    """Several traces as one, in arrival order (e.g. a long-prompt class mixed into short chat)."""
    return sorted((r for trace in traces for r in trace), key=lambda r: r.arrival_time)


def conversations(
    num_conversations: int,
    turns: int,
    *,
    request_rate: float,
    turn_len: LengthDist,
    output_len: LengthDist,
    think_time_s: float = 5.0,
    num_prefix_groups: int = 0,
    prefix_len: int = 0,
    max_prompt_len: int | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """Multi-turn chat: `num_conversations` sessions starting at `request_rate` per second (Poisson), each of
    `turns` requests `think_time_s` apart (exponential gaps with that mean). Turn k's prompt is the session's
    first k messages (`turn_len` tokens each, after the group's system prompt of `prefix_len` tokens when there
    are prefix groups), so it starts with turn k-1's whole prompt (`TraceRequest.session`); the replies are
    not in the next prompt (the simulator's made-up output tokens would not match a real model's). A
    conversation ends early when its prompt would pass `max_prompt_len`."""
    if num_conversations < 1 or turns < 1:
        raise ValueError(f"conversations and turns must be >= 1, got {num_conversations} and {turns}")
    if num_prefix_groups and prefix_len < 1:
        raise ValueError("prefix groups need prefix_len >= 1")
    rng = np.random.default_rng(seed)
    starts = arrival_times(rng, num_conversations, request_rate)
    trace = []
    for c in range(num_conversations):
        gaps = rng.exponential(think_time_s, turns)
        messages = turn_len.sample(rng, turns)
        outputs = output_len.sample(rng, turns)
        group = int(rng.integers(num_prefix_groups)) if num_prefix_groups else None
        shared = prefix_len if group is not None else 0
        t, length = float(starts[c]), shared
        for k in range(turns):
            length += int(messages[k])
            if max_prompt_len is not None and length > max_prompt_len:
                break
            trace.append(
                TraceRequest(
                    arrival_time=round(t, 6),
                    output_len=int(outputs[k]),
                    prompt_len=length,
                    prefix_group=f"g{group}" if group is not None else None,
                    prefix_len=shared,
                    session=f"c{c}",
                )
            )
            t += float(gaps[k])
    return sorted(trace, key=lambda r: r.arrival_time)

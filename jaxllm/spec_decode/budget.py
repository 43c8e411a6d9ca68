"""Load-aware speculation: how many drafts a request may verify this step, from what they have been worth.

Verifying d drafts costs d more query rows. At batch 1 on a memory-bound step they are nearly free; at batch
32 on a CPU the step is compute-bound and every row costs (vLLM #19254: n-gram slower than none under load).
So each step takes the cap k' in [0, k] that maximises expected tokens per second:

    sum over decodes of E[tokens | min(drafts, k')]  /  (cost(tokens the step would run with k') + k' * draft)

with E from the acceptance at each draft position (1 + sum_j prod_{i<=j} alpha_i): each request's own, which
starts at the engine's and moves to what its verifications show (`OWN_WEIGHT`), so after copy-like work a chat
request's rejected drafts turn speculation down for it alone; cost from the
measured time of earlier steps of the same size (token counts rounded up to a power of two, as the buckets
are), and `draft` the measured time proposing takes per draft position (a draft model's step; ~0 for
n-gram). Full speculation and none are measured first; a size that might be the best (within
`REFRESH_MARGIN` of it, by its measurements or, until it has `EXPLORE` of them, by interpolation between the
others) is measured before the rule trusts it, since the buckets' costs are not smooth (on a CPU, 5 rows of
quantized weights cost twice 4), while sizes that cannot win cost no exploring. A size's estimate is the
median of its last `WINDOW` measurements,
so one step slowed (or sped up) by a busy machine neither hides a size nor sticks to it; a size that might be
the best (within `REFRESH_MARGIN` of it) is measured again once its last measurement is `STALE_STEPS` steps
old. Drafts are verified only when they promise `GAIN_MARGIN` times the rate of none: where the gain is
marginal (a compute-bound batch), the noise of the estimates must not decide.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

PRIOR_ACCEPTANCE = 0.6  # per-position acceptance assumed before any draft is verified
EMA = 0.2  # weight of the newest measurement in the running mean of proposing time
EXPLORE = 3  # measurements of each step size before its estimate is trusted
WINDOW = 5  # a size's estimate: the median of its last this many measurements
GAIN_MARGIN = 1.25  # drafts are verified only if their predicted rate is this many times no speculation's
STALE_STEPS = 256  # steps after which a size that might be the best is measured again
REFRESH_MARGIN = 0.85  # ... "might": its predicted rate is at least this share of the best's
OWN_WEIGHT = 4.0  # the engine's acceptance counts as this many verifications in a request's own estimate


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DraftBudget:
    def __init__(self, k: int, disable_by_batch_size: int | None = None):
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.step_seconds: dict[int, float] = {}  # step size (power of two tokens) → estimated seconds
        self.samples: dict[int, int] = {}  # step size → steps measured
        self._recent: dict[int, deque[float]] = {}  # step size → its last WINDOW measurements
        self.measured_at: dict[int, int] = {}  # step size → `steps` at its last measurement
        self.steps = 0  # steps measured
        self.draft_seconds = 0.0  # running mean of proposing time per draft position (a draft model's step)
        self.reached = [0] * k  # verifications that had a draft at position j
        self.accepted = [0] * k  # ... and accepted it
        self._own: dict[str, tuple[list[int], list[int]]] = {}  # request id → its own (reached, accepted)

    # ---- measurements ------------------------------------------------------------------

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        size = _pow2_at_least(num_tokens)
        self.steps += 1
        recent = self._recent.setdefault(size, deque(maxlen=WINDOW))
        recent.append(seconds)
        self.step_seconds[size] = statistics.median(recent)
        self.samples[size] = self.samples.get(size, 0) + 1
        self.measured_at[size] = self.steps

    def observe_drafting(self, seconds_per_position: float) -> None:
        self.draft_seconds = (1 - EMA) * self.draft_seconds + EMA * seconds_per_position

    def observe_verification(self, num_drafts: int, num_accepted: int, request_id: str | None = None) -> None:
        counts = [(self.reached, self.accepted)]
        if request_id is not None:
            counts.append(self._own.setdefault(request_id, ([0] * self.k, [0] * self.k)))
        for reached, accepted in counts:
            for j in range(min(num_drafts, num_accepted + 1)):  # positions past the first rejection were not tried
                reached[j] += 1
                accepted[j] += j < num_accepted

    def forget(self, request_id: str) -> None:
        """The request finished: its own acceptance counts go."""
        self._own.pop(request_id, None)

    # ---- the decision ------------------------------------------------------------------

    def expected_tokens(self, num_drafts: int, request_id: str | None = None) -> float:
        """Tokens one verification of `num_drafts` drafts yields on average, the target's own token included (for
        `request_id`: from its own verifications, the engine's counting as `OWN_WEIGHT` of them)."""
        own = self._own.get(request_id) if request_id is not None else None
        total, chain = 1.0, 1.0
        for j in range(num_drafts):
            alpha = (self.accepted[j] + PRIOR_ACCEPTANCE) / (self.reached[j] + 1)  # one pseudo-count of the prior
            if own is not None:
                alpha = (own[1][j] + OWN_WEIGHT * alpha) / (own[0][j] + OWN_WEIGHT)
            chain *= alpha
            total += chain
        return total

    def cost(self, num_tokens: int) -> float:
        """Seconds a step of `num_tokens` takes: measured for its size, else interpolated (log-linearly in the
        size) between the nearest measured sizes, else the nearest measured size's."""
        size = _pow2_at_least(num_tokens)
        return self.step_seconds[size] if size in self.step_seconds else self._interpolated(size)

    def _interpolated(self, size: int) -> float:
        """The cost of `size` from the other measured sizes alone."""
        below = [s for s in self.step_seconds if s < size]
        above = [s for s in self.step_seconds if s > size]
        if not below or not above:
            return self.step_seconds[max(below) if below else min(above)]
        lo, hi = max(below), min(above)
        share = (math.log2(size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return self.step_seconds[lo] + share * (self.step_seconds[hi] - self.step_seconds[lo])

    def cap(
        self, drafts: list[int], other_tokens: int, limit: int | None = None, requests: list[str] | None = None
    ) -> int:
        """The drafts per request to verify this step; `drafts`: how many each decode has, `other_tokens`:
        the step's prefill tokens, `limit`: the most tokens a step takes, `requests`: the decodes' request ids
        (their own acceptance; None: the engine's). Full speculation and none are measured first; then the best
        by the costs, unless a size that might be the best is measured again first: one measured fewer than
        `EXPLORE` times (judged by the lesser of its measurements' median and the other sizes' interpolation, so
        one slow first step does not hide it), or one not measured for `STALE_STEPS` steps."""
        if not drafts or not any(drafts):
            return 0
        if self.disable_by_batch_size is not None and len(drafts) >= self.disable_by_batch_size:
            return 0
        tokens = [other_tokens + sum(1 + min(d, k) for d in drafts) for k in range(self.k + 1)]
        if limit is not None:
            tokens = [min(t, limit) for t in tokens]
        sizes = [_pow2_at_least(t) for t in tokens]
        for k in (self.k, 0):
            if sizes[k] not in self.samples:
                return k
        ids = requests if requests is not None else [None] * len(drafts)
        gains = [
            sum(self.expected_tokens(min(d, k), r) for d, r in zip(drafts, ids, strict=True)) for k in range(self.k + 1)
        ]
        rates = [gains[k] / (self.cost(tokens[k]) + k * self.draft_seconds) for k in range(self.k + 1)]
        best = 0
        for k in range(1, self.k + 1):
            if rates[k] > rates[best] * (GAIN_MARGIN if best == 0 else 1.0001):
                best = k

        def pending(k: int) -> bool:
            size, count = sizes[k], self.samples.get(sizes[k], 0)
            if count >= EXPLORE and self.steps - self.measured_at[size] < STALE_STEPS:
                return False
            seconds = self.cost(tokens[k])
            if count < EXPLORE and len(self.step_seconds) > (size in self.step_seconds):
                seconds = min(seconds, self._interpolated(size))  # optimistic: a slow first step must not hide it
            return gains[k] / (seconds + k * self.draft_seconds) >= REFRESH_MARGIN * rates[best]

        due = [k for k in range(self.k + 1) if pending(k)]
        return (
            min(due, key=lambda k: (self.samples.get(sizes[k], 0), self.measured_at.get(sizes[k], -1))) if due else best
        )

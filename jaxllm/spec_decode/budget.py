"""Load-aware speculation: how many drafts a request may verify this step, from what they have been worth.

Verifying d drafts costs d more query rows. At batch 1 on a memory-bound step they are nearly free; at batch
32 on a CPU the step is compute-bound and every row costs (vLLM #19254: n-gram slower than none under load).
So each step takes the cap k' in [0, k] that maximises expected tokens per second:

    sum over decodes of E[tokens | min(drafts, k')]  /  (cost(tokens the step would run with k') + k' * draft)

with E from the measured acceptance at each draft position (1 + sum_j prod_{i<=j} alpha_i), cost from the
measured time of earlier steps of the same size (token counts rounded up to a power of two, as the buckets
are), and `draft` the measured time proposing takes per draft position (a draft model's step; ~0 for
n-gram). The sizes with no speculation and with full speculation are each tried once before the rule
decides, so it never rests on a guess about either end; sizes between them are interpolated.
"""

from __future__ import annotations

import math

PRIOR_ACCEPTANCE = 0.6  # per-position acceptance assumed before any draft is verified
EMA = 0.2  # weight of the newest measurement in the running estimates


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DraftBudget:
    def __init__(self, k: int, disable_by_batch_size: int | None = None):
        self.k = k
        self.disable_by_batch_size = disable_by_batch_size
        self.step_seconds: dict[int, float] = {}  # step size (power of two tokens) → running mean seconds
        self.draft_seconds = 0.0  # running mean of proposing time per draft position (a draft model's step)
        self.reached = [0] * k  # verifications that had a draft at position j
        self.accepted = [0] * k  # ... and accepted it

    # ---- measurements ------------------------------------------------------------------

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        size = _pow2_at_least(num_tokens)
        old = self.step_seconds.get(size)
        self.step_seconds[size] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def observe_drafting(self, seconds_per_position: float) -> None:
        self.draft_seconds = (1 - EMA) * self.draft_seconds + EMA * seconds_per_position

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        for j in range(min(num_drafts, num_accepted + 1)):  # positions past the first rejection were not tried
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted

    # ---- the decision ------------------------------------------------------------------

    def expected_tokens(self, num_drafts: int) -> float:
        """Tokens one verification of `num_drafts` drafts yields on average, the target's own token included."""
        total, chain = 1.0, 1.0
        for j in range(num_drafts):
            alpha = (self.accepted[j] + PRIOR_ACCEPTANCE) / (self.reached[j] + 1)  # one pseudo-count of the prior
            chain *= alpha
            total += chain
        return total

    def cost(self, num_tokens: int) -> float:
        """Seconds a step of `num_tokens` takes: measured for its size, else interpolated (log-linearly in the
        size) between the nearest measured sizes, else the nearest measured size's."""
        size = _pow2_at_least(num_tokens)
        if size in self.step_seconds:
            return self.step_seconds[size]
        below = [s for s in self.step_seconds if s < size]
        above = [s for s in self.step_seconds if s > size]
        if not below or not above:
            return self.step_seconds[max(below) if below else min(above)]
        lo, hi = max(below), min(above)
        share = (math.log2(size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return self.step_seconds[lo] + share * (self.step_seconds[hi] - self.step_seconds[lo])

    def cap(self, drafts: list[int], other_tokens: int, limit: int | None = None) -> int:
        """The drafts per request to verify this step; `drafts`: how many each decode has, `other_tokens`:
        the step's prefill tokens, `limit`: the most tokens a step takes. Sizes never measured are tried
        first: no speculation, then full speculation (one step each), so the choice rests on measured costs."""
        if not drafts or not any(drafts):
            return 0
        if self.disable_by_batch_size is not None and len(drafts) >= self.disable_by_batch_size:
            return 0
        if not self.step_seconds:
            return self.k
        tokens = [other_tokens + sum(1 + min(d, k) for d in drafts) for k in range(self.k + 1)]
        if limit is not None:
            tokens = [min(t, limit) for t in tokens]
        for k in (0, self.k):
            if _pow2_at_least(tokens[k]) not in self.step_seconds:
                return k
        best, best_rate = 0, 0.0
        for k in range(self.k + 1):
            cost = self.cost(tokens[k]) + k * self.draft_seconds
            rate = sum(self.expected_tokens(min(d, k)) for d in drafts) / cost
            if rate > best_rate * 1.0001:
                best, best_rate = k, rate
        return best

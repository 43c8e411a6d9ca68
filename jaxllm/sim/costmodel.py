"""The step-time cost model: how long one engine step takes, from what the scheduler put in it.

Form (fitted by `jaxllm calibrate`):

    t(step) = base(T_b) + a · context_tokens + b · attention_pairs + c · num_rows + p · [prefill in step]

- `T_b` is the compiled bucket the step runs in (the token count rounded up to a power of two,
  capped at max_num_batched_tokens). The engine pads every step to its bucket, so the dense work
  — weight reads and matmuls, which dominate a small model — is a per-bucket constant, not a
  function of the real token count. `base` is measured per bucket and interpolated linearly in
  T_b between measured buckets (and extrapolated from the last two) for other bucket sizes.
- `context_tokens` = Σ over sequences of the KV length read (start + new tokens): the paged
  attention's KV reads, the term that grows with context during decode.
- `attention_pairs` = Σ new tokens × KV length: the quadratic attention work of prefill chunks.
- `num_rows`: the step's rows of logits — one per sequence, one more per draft token it verifies
  (speculative decoding) — for the per-row host work (input assembly, sampling rows, scheduler and
  output bookkeeping). Without speculation it is the number of sequences. The logits and the sampler
  themselves are computed for the bucket's padded rows, a per-bucket constant in `base`.
- `experts_touched(T)` (a mixture of experts only, `moe_experts` and `moe_top_k` set): the expected number of
  distinct experts a sparse layer reads for the step's T real tokens, E · (1 - (1 - k/E)^T) for routing spread
  evenly over the E experts (a step reads each chosen expert's weights once, model/moe.py). The bucket's
  padding rows choose the same few experts and weigh in `base`. A decode step of 1 token reads k experts, one
  of 64 tokens nearly all of them: the term that makes a MoE's step time grow with its tokens inside a bucket.
- `[prefill in step]`: 1 when the step carries a prefill chunk (more tokens than rows of logits: a
  verification of d drafts is d + 1 tokens and d + 1 rows, so it is not a prefill): what
  such a step takes in a live run beyond its time in the isolated sweep. On a CPU it keeps every
  core busy, so other work lengthens it (in a server, the front end answering arrivals and
  streaming first tokens, which land on exactly these steps), and after single-thread decode steps
  its second thread has to wake. Fitted on TTFT by the calibration's busy trace
  (`jaxllm.sim.calibrate.fit_event_costs`); measured on a 2-core VM: 5-13 ms offline, 0-12 ms in a
  server, on 45-55 ms 64-token steps.

Besides the step time, two per-event costs (measured by `jaxllm calibrate`, the first in its server pass):

- `request_latency_s`: the serving front-end's share of each request (HTTP, hand-off to the
  engine loop, streaming the first chunk back), measured as the client's mean TTFT minus the
  server's own (its /metrics): the simulator lets a request reach the scheduler that long after
  it was sent. 0 describes the offline engine.
- `idle_wake_s`: how much longer the first step after the engine sat idle takes than the same
  step back to back (measured on a 2-core VM, in-process: a 64-token prefill 1.33-1.41x after any
  idle gap from 0.1 to 3 s; fitted 6-17 ms; a machine effect — threads and caches waking — not
  scheduling work). Fitted together with `per_prefill_step_s` (`fit_event_costs`), offline as well.

Coefficients are fitted by least squares on relative error and kept non-negative. No JAX here.

Pipeline parallelism (`PipelineCost`) reuses the one-stage model: a stage's time for a batch is its layers'
share of the batch's step time plus, after the first stage, the copy of the hidden states into it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

import numpy as np

FORM = "base(bucket) + a*context_tokens + b*attention_pairs + c*num_rows + p*[prefill in step]"
MOE_FORM = FORM + " + e*experts_touched(num_tokens)"


def experts_touched(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts a layer reads for `num_tokens` tokens each choosing `top_k` of `num_experts`
    evenly: each expert is missed by a token with probability 1 - k/E."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on. `num_rows`: rows of logits (`SchedulerOutput.num_rows`: one per
    sequence plus one per draft token verified); 0, the default, means one per sequence (no drafts)."""

    num_tokens: int
    num_seqs: int
    context_tokens: int
    attention_pairs: int
    num_rows: int = 0

    def __post_init__(self):
        if self.num_rows == 0:
            object.__setattr__(self, "num_rows", self.num_seqs)

    @classmethod
    def of(cls, out) -> StepShape:
        """From a `SchedulerOutput` (a verification of d drafts: d + 1 tokens, d + 1 rows of one sequence)."""
        tokens = context = pairs = 0
        for s in out.scheduled:
            kv_len = s.start + s.num_new_tokens
            tokens += s.num_new_tokens
            context += kv_len
            pairs += s.num_new_tokens * kv_len
        return cls(tokens, len(out.scheduled), context, pairs, out.num_rows)


def bucket_tokens(num_tokens: int, max_num_batched_tokens: int) -> int:
    """The token bucket a step runs in (jaxllm.runner.buckets: powers of two, capped at the maximum)."""
    size = 1
    while size < num_tokens:
        size *= 2
    return min(size, max_num_batched_tokens)


# the copy of a batch's hidden states from one pipeline stage to the next (`PipelineCost`), measured on a 2-core
# x86 VM (Dec 5): jax.device_put of (T, 576) float32 (SmolLM2-135M's hidden size) between two host-platform CPU
# devices, ~120 us for any T up to 64, plus 0.2-0.7 us per token beyond (load average 2.3)
DEFAULT_PP_TRANSFER_LATENCY_S = 1e-4
DEFAULT_PP_TRANSFER_S_PER_TOKEN = 2e-7


@dataclass(frozen=True)
class PipelineCost:
    """Per-stage times of a pipeline-parallel step, from a one-stage step time (a `CostModel`'s, or any).

    Kept simple: stage s runs `stage_shares[s]` of the whole step time — its layers over all layers — so the
    embedding, the LM head, the sampler and the per-row host work, which the one-stage model does not separate
    from the layers, are split in the same proportion rather than put on the first and last stages. Every
    stage after the first also waits for the previous stage's hidden states: `transfer_latency_s` plus
    `transfer_s_per_token` per token of the step's bucket (the runner copies the padded hidden states), charged
    to the receiving stage. With one stage it is the step time itself.
    """

    stage_shares: tuple[float, ...] = (1.0,)
    transfer_latency_s: float = DEFAULT_PP_TRANSFER_LATENCY_S
    transfer_s_per_token: float = DEFAULT_PP_TRANSFER_S_PER_TOKEN

    def __post_init__(self):
        if not self.stage_shares or min(self.stage_shares) <= 0 or abs(sum(self.stage_shares) - 1) > 1e-9:
            raise ValueError(f"stage_shares must be positive fractions summing to 1, got {self.stage_shares}")
        for name in ("transfer_latency_s", "transfer_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def of_layers(cls, stage_layers: tuple[int, ...] | list[int], **transfer) -> PipelineCost:
        """Shares from each stage's layer count (`jaxllm.parallel.pipeline.layer_ranges`'s split)."""
        total = sum(stage_layers)
        return cls(tuple(n / total for n in stage_layers), **transfer)

    @property
    def num_stages(self) -> int:
        return len(self.stage_shares)

    def transfer_time(self, bucket: int) -> float:
        """One stage boundary's copy of a step of `bucket` (padded) tokens."""
        return self.transfer_latency_s + self.transfer_s_per_token * bucket

    def stage_times(self, step_seconds: float, bucket: int) -> list[float]:
        """Each stage's time for a step the one-stage model prices at `step_seconds`."""
        transfer = self.transfer_time(bucket)
        return [step_seconds * share + (transfer if s else 0.0) for s, share in enumerate(self.stage_shares)]


class EventCosts(TypedDict):
    """`simulate()`'s keyword arguments for the per-request and per-wake-up costs."""

    request_latency_s: float
    idle_wake_s: float


@dataclass
class CostModel:
    bucket_tokens: list[int]  # measured buckets (token counts), ascending
    bucket_base_s: list[float]
    per_context_token_s: float = 0.0
    per_attention_pair_s: float = 0.0
    per_seq_s: float = 0.0  # c: per row of logits (the name is from before speculation: a row per sequence)
    per_prefill_step_s: float = 0.0  # p: extra time of a step that carries a prefill chunk
    request_latency_s: float = 0.0  # serving front-end, per request (see the module docstring)
    idle_wake_s: float = 0.0  # extra time of the first step after the engine was idle
    moe_experts: int = 0  # a mixture of experts: E and k of its routing (0: a dense model, no experts term)
    moe_top_k: int = 0
    per_expert_touched_s: float = 0.0  # e: per distinct expert a sparse layer reads (every sparse layer's share)
    fit: dict = field(default_factory=dict)  # fit error and sample counts
    engine: dict = field(default_factory=dict)  # the engine it was measured on
    form: str = FORM

    def base(self, bucket: int) -> float:
        xs, ys = self.bucket_tokens, self.bucket_base_s
        if len(xs) == 1:
            return ys[0] * bucket / xs[0]
        if bucket > xs[-1]:  # extrapolate from the last two buckets
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (bucket - xs[-1])
        return float(np.interp(bucket, xs, ys))

    def step_time(self, shape: StepShape, max_num_batched_tokens: int) -> float:
        return (
            self.base(bucket_tokens(shape.num_tokens, max_num_batched_tokens))
            + self.per_context_token_s * shape.context_tokens
            + self.per_attention_pair_s * shape.attention_pairs
            + self.per_seq_s * shape.num_rows
            + (self.per_prefill_step_s if shape.num_tokens > shape.num_rows else 0.0)
            + self.per_expert_touched_s * self.experts_touched(shape.num_tokens)
        )

    def experts_touched(self, num_tokens: int) -> float:
        """`experts_touched` for this model's routing; 0 for a dense model."""
        return experts_touched(num_tokens, self.moe_experts, self.moe_top_k) if self.moe_experts else 0.0

    def event_costs(self) -> EventCosts:
        """`simulate()`'s per-request and per-wake-up costs from this model."""
        return {"request_latency_s": self.request_latency_s, "idle_wake_s": self.idle_wake_s}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        try:
            model = cls(**data)
        except TypeError as e:
            raise ValueError(f"{path}: not a jaxllm cost model ({e})") from None
        if not model.bucket_tokens or len(model.bucket_tokens) != len(model.bucket_base_s):
            raise ValueError(f"{path}: bucket_tokens and bucket_base_s must be non-empty and of equal length")
        return model


def fit_cost_model(
    samples: list[tuple[StepShape, float]], max_num_batched_tokens: int, moe: tuple[int, int] | None = None
) -> CostModel:
    """Least squares on relative error (every step counts alike, short or long), coefficients >= 0.

    Unknowns: one base per bucket seen, then a, b, c (c per row of logits), and e for a mixture of experts (`moe`:
    its E and k). A term whose coefficient comes out negative (noise, or work the hardware hides) is dropped and
    the rest refitted.
    """
    if not samples:
        raise ValueError("no samples to fit")
    experts, top_k = moe or (0, 0)
    shell = CostModel([1], [0.0], moe_experts=experts, moe_top_k=top_k)  # (its `experts_touched`)
    buckets = sorted({bucket_tokens(s.num_tokens, max_num_batched_tokens) for s, _ in samples})
    column = {b: i for i, b in enumerate(buckets)}
    x = np.zeros((len(samples), len(buckets) + 4))
    y = np.array([t for _, t in samples])
    for row, (s, _) in enumerate(samples):
        x[row, column[bucket_tokens(s.num_tokens, max_num_batched_tokens)]] = 1.0
        x[row, len(buckets) :] = (s.context_tokens, s.attention_pairs, s.num_rows, shell.experts_touched(s.num_tokens))
    if not experts:
        x = x[:, :-1]
    active = list(range(x.shape[1]))
    while True:
        weights = 1.0 / y  # relative error
        coef_active, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        coef = np.zeros(x.shape[1])
        coef[active] = coef_active
        negative = [i for i in active if coef[i] < 0 and i >= len(buckets)]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coef[i]))
    base = np.maximum(coef[: len(buckets)], 0.0)
    coef[: len(buckets)] = base
    rel = np.abs(x @ coef - y) / y
    a, b, c, *e = coef[len(buckets) :]
    return CostModel(
        bucket_tokens=buckets,
        bucket_base_s=[float(v) for v in base],
        per_context_token_s=float(a),
        per_attention_pair_s=float(b),
        per_seq_s=float(c),
        moe_experts=experts,
        moe_top_k=top_k,
        per_expert_touched_s=float(e[0]) if e else 0.0,
        form=MOE_FORM if experts else FORM,
        fit={
            "samples": len(samples),
            "mean_abs_rel_error": float(rel.mean()),
            "p90_abs_rel_error": float(np.percentile(rel, 90)),
            "max_abs_rel_error": float(rel.max()),
        },
    )

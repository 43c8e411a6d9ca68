"""The device sweep of `jaxllm calibrate` (sim/calibrate.py, pass 1): synthetic steps straight into the runner.

Each step is a grid point of (sequences, tokens per sequence, context, drafts): pure decode batches at several
context lengths, single prefill chunks of every bucket size at several starting positions, mixed steps (decodes
plus one prefill chunk), and speculative decoding's verification steps. Each is timed as the median of a few
rounds over the whole sweep, after one warm run.
"""

from __future__ import annotations

import time

import numpy as np

from jaxllm.request import Request
from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxllm.sim.costmodel import CostModel, StepShape
from jaxllm.sim.engine_run import forced_params

# drafts per sequence in the sweep's verification steps: d + 1 rows a power of two, as the buckets' row counts
VERIFY_DRAFTS = (1, 3, 7, 15)


def sweep_points(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, capacity_tokens: int
) -> list[list[tuple[int, ...]]]:
    """Steps to time, each a list of (start, num_new_tokens) or (start, num_new_tokens, num_drafts) per sequence
    (num_new_tokens counts the drafts, as `ScheduledRequest` does), within the engine's limits: a step has at
    most max_num_seqs rows of logits, one per sequence and one per draft (as the scheduler keeps it)."""
    contexts = sorted({c for c in (16, 64, 256, max_model_len // 2, max_model_len - 1) if 0 < c < max_model_len})
    seq_counts = sorted({min(2**i, max_num_seqs) for i in range(max_num_seqs.bit_length() + 1)})
    chunks = sorted({min(2**i, max_num_batched_tokens) for i in range(max_num_batched_tokens.bit_length() + 1)})
    points: list[list[tuple[int, ...]]] = []
    for seqs in seq_counts:  # decode batches
        for ctx in contexts:
            if seqs * (ctx + 1) <= capacity_tokens:
                points.append([(ctx, 1)] * seqs)
    for chunk in chunks:  # one prefill chunk
        for start in (0, max_model_len // 4, max_model_len // 2):
            if start + chunk <= max_model_len and start + chunk <= capacity_tokens:
                points.append([(start, chunk)])
    for seqs in seq_counts[1:]:  # mixed: decodes plus a chunk that fills the step
        chunk = max_num_batched_tokens - (seqs - 1)
        for ctx in contexts[::2]:
            if chunk >= 1 and (seqs - 1) * (ctx + 1) + chunk <= capacity_tokens and chunk <= max_model_len:
                points.append([(ctx, 1)] * (seqs - 1) + [(0, chunk)])
    for seqs in seq_counts:  # verification: d drafts per sequence, d + 1 rows each
        for d in VERIFY_DRAFTS:
            rows = seqs * (d + 1)
            if rows > min(max_num_seqs, max_num_batched_tokens):
                continue
            for ctx in contexts[::2]:
                if ctx + d + 1 <= max_model_len and seqs * (ctx + d + 1) <= capacity_tokens:
                    points.append([(ctx, d + 1, d)] * seqs)
            # beside a prefill chunk that fills the step (one more row)
            chunk, ctx = max_num_batched_tokens - rows, contexts[0]
            if rows < max_num_seqs and chunk >= 1 and seqs * (ctx + d + 1) + chunk <= capacity_tokens:
                points.append([(ctx, d + 1, d)] * seqs + [(0, min(chunk, max_model_len))])
    return points


def _time_step(core, layout: list[tuple[int, ...]], warm: bool) -> tuple[StepShape, float]:
    kv, rng = core.kv, np.random.default_rng(len(layout))
    vocab = core.loaded.arch.vocab_size
    requests, scheduled = [], []
    try:
        for i, (start, n, *rest) in enumerate(layout):
            d = rest[0] if rest else 0  # drafts: the last n - d tokens are known, the d after them proposed
            tokens = rng.integers(1000, min(vocab, 30000), start + n).tolist()
            request = Request(f"calibrate-{i}", tokens[: start + n - d], forced_params(1))  # greedy, as every replay
            if not kv.allocate_slots(request, start + n):
                raise ValueError(f"the KV pool is too small for calibration step {layout}")
            requests.append(request)
            tables = kv.block_tables(request.request_id)
            scheduled.append(ScheduledRequest(request, n, start, tables, tokens[start + n - d :]))
        out = SchedulerOutput(step=-1, scheduled=scheduled)  # assigns each request its rows of logits
        if warm:
            core.runner.execute(out)  # first use of this bucket's executable
        begin = time.perf_counter()
        core.runner.execute(out)
        return StepShape.of(out), time.perf_counter() - begin
    finally:
        for request in requests:
            kv.free(request, uncache=True)


def time_sweep(
    core, points: list[list[tuple[int, ...]]], repeats: int, progress: bool
) -> list[tuple[StepShape, float]]:
    """Each point's median time over `repeats` rounds of the whole sweep.

    The median, not the fastest: a real run meets the machine's usual jitter, and the fastest of five
    is biased low by how much a step jitters — measured on a 2-core VM (25 back-to-back runs each),
    median/fastest 1.11-1.13 for decode steps but 1.18 for a 64-token prefill and 1.27 for a mixed
    step, which had the model predict steps carrying a prefill 15-24 % short. Rounds, not back-to-back
    repeats: a neighbour's burst lasting seconds then disturbs one round of the points it overlaps,
    and the median drops it.
    """
    from tqdm.auto import tqdm

    times: list[list[float]] = [[] for _ in points]
    shapes: list[StepShape] = []  # each point's, from the first round (every round has the same)
    with tqdm(total=repeats * len(points), desc="Timing steps", disable=not progress, unit="step") as bar:
        for round_ in range(repeats):
            for i, layout in enumerate(points):
                shape, seconds = _time_step(core, layout, warm=round_ == 0)
                if round_ == 0:
                    shapes.append(shape)
                times[i].append(seconds)
                bar.update()
    return [(shape, float(np.median(t))) for shape, t in zip(shapes, times, strict=True)]


def verification_fit(model: CostModel, samples: list[tuple[StepShape, float]], max_num_batched_tokens: int) -> dict:
    """The fit's error on the sweep's verification steps alone (rows of logits beyond one per sequence)."""
    rel = [
        abs(model.step_time(shape, max_num_batched_tokens) - seconds) / seconds
        for shape, seconds in samples
        if shape.num_rows > shape.num_seqs
    ]
    if not rel:
        return {"verify_samples": 0}
    return {
        "verify_samples": len(rel),
        "verify_mean_abs_rel_error": float(np.mean(rel)),
        "verify_max_abs_rel_error": float(np.max(rel)),
    }

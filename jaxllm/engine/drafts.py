"""The scheduler's third phase: drafts to verify, in the rows and tokens a step has left. Pure Python.

Each decoding request in the step gets at most the load-aware cap's drafts (spec_decode/budget.py), never more
than the step's token budget and rows of logits have left, nor past its max_tokens or max_model_len; a request
whose extra KV slots do not fit verifies none this step.
"""

from __future__ import annotations

from jaxllm.config import SchedulerConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.request import Request
from jaxllm.scheduler_output import SchedulerOutput
from jaxllm.spec_decode.budget import DraftBudget


def add_drafts(
    out: SchedulerOutput, budget: int, rows: int, draft_budget: DraftBudget, kv: KVCacheManager, config: SchedulerConfig
) -> None:
    """Give this step's decodes their drafts, within `budget` tokens and `rows` rows of logits."""
    decodes = [s for s in out.scheduled if s.num_new_tokens == 1 and s.samples]
    if not any(s.request.draft_token_ids for s in decodes):
        return
    prefill = out.num_tokens - len(decodes)
    counts = [len(s.request.draft_token_ids) for s in decodes]
    cap = draft_budget.cap(counts, prefill, config.max_num_batched_tokens, [s.request.request_id for s in decodes])
    for scheduled in decodes:
        drafts = _drafts(scheduled.request, min(cap, budget, rows), config)
        if drafts and kv.allocate_slots(scheduled.request, 1 + len(drafts)):
            scheduled.draft_token_ids = drafts
            scheduled.num_new_tokens += len(drafts)
            budget, rows = budget - len(drafts), rows - len(drafts)
    out.renumber()


def _drafts(request: Request, limit: int, config: SchedulerConfig) -> list[int]:
    """The request's drafts to verify: at most `limit`, and never past max_tokens or max_model_len."""
    params = request.sampling_params
    limit = min(limit, config.max_model_len - request.num_tokens - 1)
    if params.max_tokens is not None:
        limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
    return request.draft_token_ids[: max(limit, 0)]

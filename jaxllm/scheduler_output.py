"""The step contract: what the scheduler hands the device side for one step (`SchedulerOutput`, one
`ScheduledRequest` per request), and the limits both sides size from it (rows of logits).

The runner, the multi-host step broadcast and a draft model's runner read only this module (and `request.py`),
never the scheduling algorithm (engine/scheduler.py), as vLLM's workers read only its `sched/output.py`. Pure
Python: no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxllm.config import SchedulerConfig, SpeculativeConfig
from jaxllm.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from `start` (draft tokens included)
    start: int  # num_computed_tokens when scheduled: the position of the first new token
    block_ids: list[list[int]]  # the request's block table of each KV cache group (the manager's lists)
    draft_token_ids: list[int] = field(default_factory=list)  # proposed tokens the step verifies (speculation)
    scores_prompt: bool = False  # prompt_logprobs: a row of logits per new token, each scoring the next
    logits_row: int = 0  # its first row of logits (SchedulerOutput.add)
    # async scheduling: output tokens that unapplied steps sample before this one (its last input token is
    # the previous step's sampled token at row `prev_row`, still on the device; -1: every input is known)
    num_placeholders: int = 0
    prev_row: int = -1
    lora_slot: int = 0  # the device slot of its LoRA adapter (0: none), given by the engine's LoRA manager
    # whether this step reaches the request's last token, so its logits give a new token (fixed when
    # scheduled: the request's token count moves when an earlier step's output is applied)
    samples: bool = field(init=False)

    def __post_init__(self):
        known = self.request.num_tokens + self.num_placeholders
        self.samples = self.start + self.num_new_tokens - len(self.draft_token_ids) == known

    @property
    def num_rows(self) -> int:
        """Rows of logits: one per new token when scoring the prompt, else one plus one per draft."""
        return self.num_new_tokens if self.scores_prompt else 1 + len(self.draft_token_ids)

    @property
    def sample_row(self) -> int:
        """The row whose token follows the last known one (verifying drafts: the first of d + 1)."""
        return self.logits_row + (self.num_new_tokens - 1 if self.scores_prompt else 0)


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted in this step
    # a KV connector's instructions for the runner side before the forward (kv_transfer/base.py's
    # KVConnectorMetadata: evicted blocks to copy out, loads to scatter or start); None without a connector
    kv_connector_metadata: Any = None
    num_rows: int = field(init=False, default=0)  # rows of logits: one per scheduled request, one per draft

    def __post_init__(self):
        scheduled, self.scheduled = self.scheduled, []
        for s in scheduled:
            self.add(s)

    def add(self, scheduled: ScheduledRequest) -> None:
        """Append a scheduled request, giving it the next rows of logits."""
        scheduled.logits_row = self.num_rows
        self.scheduled.append(scheduled)
        self.num_rows += scheduled.num_rows

    def renumber(self) -> None:
        """Give every scheduled request its rows again, in order (after drafts were added)."""
        self.num_rows = 0
        for scheduled in self.scheduled:
            scheduled.logits_row = self.num_rows
            self.num_rows += scheduled.num_rows

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def request_rows(config: SchedulerConfig, speculative: SpeculativeConfig | None) -> int:
    """Rows of logits a step gives requests and prompt scoring at most: a row per running request (max(max_num_seqs,
    k + 1), so that one lone request can always verify k drafts)."""
    k = speculative.num_speculative_tokens if speculative is not None else 0
    return max(config.max_num_seqs, 1 + k)


def max_logits_rows(config: SchedulerConfig, speculative: SpeculativeConfig | None) -> int:
    """Rows of logits a step has at most (the largest bucket's rows). With speculation, k + 1 per sequence (vLLM
    sizes its rows so), within max_num_batched_tokens (a row is a token): a full batch has rows for drafts, and the
    load-aware rule decides how many to use. The runner compiles them as buckets of their own (runner/buckets.py),
    so steps without drafts never pay for them."""
    rows = request_rows(config, speculative)
    if speculative is None:
        return rows
    drafts = config.max_num_seqs * (1 + speculative.num_speculative_tokens)
    return max(rows, min(drafts, config.max_num_batched_tokens))

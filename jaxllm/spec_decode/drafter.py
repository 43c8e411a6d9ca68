"""Between steps: the drafts each running request will verify in the next one."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

from jaxllm.config import SpeculativeConfig
from jaxllm.request import Request
from jaxllm.spec_decode.budget import DraftBudget
from jaxllm.spec_decode.ngram import NgramProposer
from jaxllm.spec_decode.stats import SpecDecodingStats


class Proposer(Protocol):
    def propose(self, requests: list[Request], k: int) -> list[list[int]]: ...

    def free(self, request_id: str) -> None: ...


class Drafter:
    """Proposes for every request that decodes next step, up to the load-aware cap (no proposing at all when
    the rule would verify none: a draft model's steps are not free). Requests with repetition, frequency or
    presence penalties do not speculate (verification row j would need drafts 0..j-1 in its penalty
    history); they are counted in `stats.num_unspeculated`. A constrained request's drafts stop at the first
    token its grammar rejects. The time proposing takes is charged to the budget per draft position."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, stats: SpecDecodingStats, budget: DraftBudget):
        self.config = config
        self.proposer = proposer
        self.stats = stats
        self.budget = budget
        self.propose_seconds = 0.0  # host (and draft model) time spent proposing

    def propose(self, running: Iterable[Request], structured, scheduler=None) -> None:
        """Set `draft_token_ids` of each running request; `structured`: the StructuredOutputManager. With async
        scheduling (`scheduler` given), a request already in a launched step gets none: its drafts would have to
        follow that step's token, still unknown (it waits for that step and is proposed for once it is applied)."""
        decoding = []
        for request in running:
            request.draft_token_ids = []
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # still prefilling
            if scheduler is not None and scheduler.has_step_in_flight(request):
                continue
            if request.sampling_params.uses_penalties:
                self.stats.num_unspeculated += 1
                continue
            decoding.append(request)
        drafts = [self.config.num_speculative_tokens] * len(decoding)
        k = self.budget.cap(drafts, 0, None, [r.request_id for r in decoding]) if decoding else 0
        if k == 0:
            return
        started = time.perf_counter()
        for request, drafts in zip(decoding, self.proposer.propose(decoding, k), strict=True):
            request.draft_token_ids = drafts[: structured.valid_prefix(request, drafts)] if drafts else []
        seconds = time.perf_counter() - started
        self.propose_seconds += seconds
        self.budget.observe_drafting(seconds / k)

    def free(self, request_id: str) -> None:
        self.proposer.free(request_id)


def make_drafter(
    config: SpeculativeConfig | None, scheduler, engine_config, vocab_size: int, mesh, executable_dir, progress
):
    """The engine's drafter for `config` (None without speculation); a draft model loads and compiles here."""
    if config is None:
        return None
    if config.method == "ngram":
        proposer: Proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from jaxllm.spec_decode.draft_model import DraftModelProposer  # loads JAX; n-gram stays pure Python

        proposer = DraftModelProposer(
            config,
            engine_config,
            vocab_size,
            scheduler.kv.num_usable_blocks + 1,
            mesh,
            executable_dir=executable_dir,
            progress=progress,
        )
    return Drafter(config, proposer, scheduler.spec_stats, scheduler.draft_budget)

"""Between steps: the drafts each running request will verify in the next one."""

from __future__ import annotations

from collections.abc import Iterable

from jaxllm.engine.request import Request
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram import NgramProposer
from jaxllm.spec_decode.stats import SpecDecodingStats


class Drafter:
    """Proposes for every request that decodes next step. Requests with repetition, frequency or presence
    penalties do not speculate (verification row j would need drafts 0..j-1 in its penalty history); they are
    counted in `stats.num_unspeculated`. A constrained request's drafts stop at the first token its grammar
    rejects."""

    def __init__(self, config: SpeculativeConfig, stats: SpecDecodingStats):
        self.config = config
        self.stats = stats
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)

    def propose(self, running: Iterable[Request], structured) -> None:
        """Set `draft_token_ids` of each running request; `structured`: the StructuredOutputManager."""
        running = list(running)
        limit = self.config.disable_by_batch_size
        for request in running:
            drafts: list[int] = []
            if limit is not None and len(running) >= limit:
                pass  # the scheduler would drop them: do not spend host time on them
            elif request.num_tokens - request.num_computed_tokens != 1:
                pass  # still prefilling
            elif request.sampling_params.uses_penalties:
                self.stats.num_unspeculated += 1
            else:
                drafts = self.proposer.propose(request, self.config.num_speculative_tokens)
                if drafts:
                    drafts = drafts[: structured.valid_prefix(request, drafts)]
            request.draft_token_ids = drafts

    def free(self, request_id: str) -> None:
        self.proposer.free(request_id)

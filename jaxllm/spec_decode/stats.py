"""Running totals of speculation, with vLLM's counter names (spec_decode_num_drafts, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """`num_drafts`: verifications of at least one draft token; `accepted_per_pos[j]`: drafts accepted at
    position j. `num_unspeculated`: decode steps of requests that may not speculate (penalties)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_unspeculated: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification yields: the accepted drafts plus the token the target adds (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

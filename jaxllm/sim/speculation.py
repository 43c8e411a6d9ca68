"""n-gram speculation in the simulator: made-up drafts, and an acceptance model that says which are accepted.

Before each step every running request about to decode is given drafts, as many as the engine's `Drafter` would
propose (k, or the load-aware cap's fewer; n-gram proposing is host work, not priced, and finds a match every
time here). The sampled row of each verified draft is made to equal the draft exactly as often as the acceptance
model says, so the real `Scheduler.update` accepts that many and appends them plus one token. The acceptance
model: a draft is accepted with probability `acceptance_rate` (the trace request's, else the run's) given the
draft before it was. Whether the draft for a request's output position p is accepted is drawn once per (seed,
request, p), from a generator seeded by the seed: reproducible, and the same positions are accepted whatever k,
load or policy (common random numbers, so two configurations differ by their own effect, not by luck).
"""

from __future__ import annotations

import hashlib

import numpy as np

from jaxllm.config import SpeculativeConfig
from jaxllm.engine.scheduler import Scheduler
from jaxllm.scheduler_output import SchedulerOutput
from jaxllm.sim.trace import TOKEN_RANGE, TraceRequest
from jaxllm.spec_decode.stats import SpecDecodingStats

DUMMY_TOKEN = TOKEN_RANGE[0]  # what every simulated step "samples"; lengths are forced, values never matter
DRAFT_TOKEN = DUMMY_TOKEN + 1  # every made-up draft; a row that rejects its draft samples DUMMY_TOKEN instead


def acceptance_draws(seed: int) -> np.random.Generator:
    """The generator of the acceptance model's draws (a stable digest of the seed, apart from the prompts')."""
    key = hashlib.blake2b(f"{seed}/acceptance".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(key, "little"))


class SimulatedSpeculation:
    def __init__(self, speculative: SpeculativeConfig, num_requests: int, acceptance_rate: float | None, seed: int):
        self.speculative, self.acceptance_rate = speculative, acceptance_rate
        self.draws = acceptance_draws(seed)
        self.accepts: dict[int, np.ndarray] = {}  # trace index → whether the draft for output position p is accepted
        self.num_decodes = 0  # request steps that computed one known token: could speculate
        self.drafted, self.accepted = [0] * num_requests, [0] * num_requests

    def arrive(self, i: int, request: TraceRequest) -> None:
        """Draw trace request i's acceptances (for every request in trace order, refused ones too: the same
        draws per index)."""
        rate = request.acceptance_rate if request.acceptance_rate is not None else self.acceptance_rate
        assert rate is not None  # simulate() checked
        self.accepts[i] = self.draws.random(request.output_len) < rate

    def propose(self, scheduler: Scheduler) -> None:
        """As the engine's `Drafter` between steps: each running request that decodes next gets drafts, as many
        as the load-aware cap allows (none at all when it allows none)."""
        assert scheduler.draft_budget is not None
        decoding = []
        for request in scheduler.running:
            request.draft_token_ids = []
            # (a request in a batch still in flight, under PP, gets none: the engine's Drafter skips it)
            if request.num_tokens - request.num_computed_tokens == 1 and not scheduler.has_step_in_flight(request):
                decoding.append(request)
        k = self.speculative.num_speculative_tokens
        cap = scheduler.draft_budget.cap([k] * len(decoding), 0) if decoding else 0
        drafts = [DRAFT_TOKEN] * cap  # one list for all: nothing mutates it
        for request in decoding:
            request.draft_token_ids = drafts

    def verdicts(self, out: SchedulerOutput, index: dict[int, int]) -> list[int]:
        """A token per row of logits: each verified draft's row equals it while the acceptance model accepts.
        `index`: id(Request) → its trace index."""
        sampled = [DUMMY_TOKEN] * out.num_rows
        for s in out.scheduled:
            request, d = s.request, len(s.draft_token_ids)
            if s.samples and s.num_new_tokens - d == 1:  # a decode: a step that may verify drafts
                self.num_decodes += 1
            if d:
                i = index[id(request)]
                first = request.num_output_tokens  # the output position the first draft stands for
                n = 0
                while n < d and self.accepts[i][first + n]:
                    n += 1
                sampled[s.logits_row : s.logits_row + n] = s.draft_token_ids[:n]
                self.drafted[i] += d
                self.accepted[i] += n
        return sampled

    def summary(self, stats: SpecDecodingStats) -> dict:
        """Speculation's counters (vLLM's names) and derived figures for the result JSON. The speculated fraction
        is of the decodes that could speculate (the load-aware cap, the token budget and the rows of logits, or
        max_tokens, left the others none)."""
        decodes = self.num_decodes
        return {
            "spec_decode_num_drafts": stats.num_drafts,
            "spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(stats.accepted_per_pos),
            "spec_decode_acceptance_rate": stats.acceptance_rate,
            "spec_decode_mean_acceptance_length": stats.mean_acceptance_length,
            "spec_decode_num_decodes": decodes,
            "spec_decode_speculated_fraction": stats.num_drafts / decodes if decodes else None,
            "spec_decode_mean_draft_tokens": stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else None,
        }

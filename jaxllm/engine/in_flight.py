"""The scheduler's view of steps launched and not yet applied (async scheduling, pipeline batches). Pure Python.

Per request: how many unapplied steps carry it, the positions they compute and the output tokens they sample
(placeholders the host does not know yet). `may_follow` decides whether a request with a step in flight may be
in the next step too.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config import SchedulerConfig
from jaxllm.request import Request
from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass
class Pending:
    """A request's part in the steps scheduled and not yet applied."""

    last: ScheduledRequest  # its entry in the newest of them
    steps: int = 0
    tokens: int = 0  # positions they compute (num_computed_tokens advances by these once applied)
    placeholders: int = 0  # output tokens they sample (unknown to the host until applied)


def _counts(s: ScheduledRequest) -> tuple[int, int]:
    """(positions computed, placeholder tokens sampled) that `s` adds to its request's pending step."""
    return s.num_new_tokens - len(s.draft_token_ids), int(s.samples and s.request.sampling_params.max_tokens != 0)


class InFlightRequests:
    def __init__(self, config: SchedulerConfig, speculating: bool):
        self.config = config
        self.speculating = speculating
        self.num_steps = 0  # steps launched and not yet applied
        self._pending: dict[str, Pending] = {}  # request id → its unapplied steps

    def get(self, request: Request) -> Pending | None:
        return self._pending.get(request.request_id)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._pending

    def launched(self, out: SchedulerOutput) -> None:
        """Count `out` in flight until `released`."""
        self.num_steps += 1
        for s in out.scheduled:
            pending = self._pending.get(s.request.request_id)
            if pending is None:
                pending = self._pending[s.request.request_id] = Pending(s)
            tokens, placeholders = _counts(s)
            pending.last = s
            pending.steps += 1
            pending.tokens += tokens
            pending.placeholders += placeholders

    def released(self, out: SchedulerOutput) -> None:
        """`out` is no longer in flight: applied, or failed on the device."""
        self.num_steps -= 1
        for s in out.scheduled:
            pending = self._pending[s.request.request_id]
            tokens, placeholders = _counts(s)
            pending.steps -= 1
            pending.tokens -= tokens
            pending.placeholders -= placeholders
            if pending.steps == 0:
                del self._pending[s.request.request_id]

    def may_follow(self, request: Request, pending: Pending) -> bool:
        """Whether a request with a step in flight may be in the next step too: only when the host knows its
        next input and what the sampler needs for it. Per input of the step (runner/input_batch.py):

        - token ids: the prompt's next chunk, or (the unapplied step samples) its sampled token, gathered on the
          device from that step's results; after drafts the number accepted, and so the next position, is
          unknown: a request that verified drafts waits (so, with speculation, does every decoding request:
          its drafts for the next step would follow the unknown token);
        - positions, slot mapping, block table, kv_lens: counts, the placeholder included;
        - temperature, top_k/p, min_p, seeds, logit_bias, logprobs: the request's fixed parameters;
        - steps (the seed's stream index) and min_tokens' bans: the output count, placeholder included;
        - history and prompt_lens (repetition / frequency / presence penalties): filled from the host's tokens,
          which lack the placeholder: such a request waits;
        - allowed (structured outputs): the grammar's next mask needs the token: a constrained request waits;
        - prompt_logprobs rows (target_ids): a request scoring its prompt waits;
        - a token that would end the request by max_tokens or max_model_len: it finishes, nothing to follow.
        A request whose unapplied step stops it (EOS, stop token or string) had its next row computed in
        vain: its result is dropped (the request is finished when that step is applied).
        """
        last, params = pending.last, request.sampling_params
        if self.config.max_concurrent_batches > 1:  # pipeline: a request is in one batch in flight at most
            return False
        if pending.steps != 1 or last.draft_token_ids or last.scores_prompt:
            return False
        if not last.samples:
            return True  # a prompt chunk: the next one is known
        if params.max_tokens == 0 or self.speculating:
            return False
        if params.uses_penalties or params.structured_outputs is not None:
            return False
        if params.max_tokens is not None and request.num_output_tokens + pending.placeholders >= params.max_tokens:
            return False
        return request.num_tokens + pending.placeholders < self.config.max_model_len

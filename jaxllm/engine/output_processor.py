"""Requests as the user sees them: each request's samples, their text (incremental detokenizers, stop strings),
logprob entries, and the `RequestOutput`s built from them after every step (vLLM's output processor).

The engine core hands it each step's new tokens (`process`) and failures (`fail`); it owns the request groups
(a request with `n` samples is `n` scheduled requests behind one output) and frees a finished group's
detokenizers, grammar matchers and drafter state.
"""

from __future__ import annotations

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.scheduler import Scheduler
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.request import Request, RequestStatus
from jaxllm.runner.model_runner import RunnerOutput
from jaxllm.scheduler_output import ScheduledRequest
from jaxllm.structured.manager import StructuredOutputManager


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, structured: StructuredOutputManager, drafter=None):
        self.tokenizer, self.scheduler, self.structured, self.drafter = tokenizer, scheduler, structured, drafter
        self.groups: dict[str, list[Request]] = {}  # user request id → its samples
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # sample id → its text so far

    def add(self, request_id: str, samples: list[Request]) -> None:
        """A new request's samples, each with a detokenizer when there is a tokenizer and it asks for text."""
        for request in samples:
            params = request.sampling_params
            if self.tokenizer is not None and params.detokenize:
                self.detokenizers[request.request_id] = IncrementalDetokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop_strings,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
        self.groups[request_id] = samples

    def process(self, request: Request, result: RunnerOutput, row: int, count: int, now: float) -> None:
        """The request's `count` new tokens (from logits row `row` on): grammar, logprobs, text, stop strings. A
        stop found at one of them drops the tokens after it."""
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        first = request.num_output_tokens - count
        params = request.sampling_params
        detok = self.detokenizers.get(request.request_id)
        ended = request.is_finished  # the scheduler's stop (EOS, stop token, length) is at the last token
        for i in range(count):
            token, last = request.output_token_ids[first + i], i == count - 1
            done = last and ended
            stop = None
            if not done and self.structured.advance(request, token):
                stop = ""  # the grammar is complete
            if params.logprobs is not None:
                request.cumulative_logprob += float(result.logprobs[row + i])
                request.logprobs.append(self._logprob_dict(token, result, row + i, params.logprobs))
            if detok is not None and (text_stop := detok.update([token])) is not None and not done:
                stop = request.stop_reason = text_stop
            if stop is not None:
                if request.is_finished:  # by the scheduler at a later token: it ends here instead
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
                del request.output_token_ids[first + i + 1 :]  # tokens verified after the stop are not output
                break
        if detok is None:
            return
        if request.is_finished:
            detok.finish()
        request.output_text += detok.get_delta()

    def record_prompt_logprobs(self, scheduled: ScheduledRequest, result: RunnerOutput) -> None:
        """The entries of the prompt tokens this chunk scored (row j: token start + j + 1), each once (a
        request recomputed after preemption scores its prompt again)."""
        request, k = scheduled.request, scheduled.request.sampling_params.prompt_logprobs
        assert k is not None, "only requests asking for prompt_logprobs score their prompt"
        entries = request.prompt_logprobs
        if not entries:
            entries.append(None)  # the first prompt token has nothing before it
        for j in range(scheduled.num_new_tokens):
            position, row = scheduled.start + j + 1, scheduled.logits_row + j
            if position != len(entries) or position >= request.num_prompt_tokens:
                continue
            token = request.prompt_token_ids[position]
            lp, rank = float(result.target_logprobs[row]), int(result.target_ranks[row])
            entries.append(self._logprob_dict(token, result, row, k, (lp, rank)))

    def _logprob_dict(
        self, token: int, result: RunnerOutput, row: int, k: int, own: tuple[float, int] | None = None
    ) -> dict[int, Logprob]:
        """`token`'s logprob and rank (`own`, else the row's sampled token's) and the row's top k."""
        entries = {
            int(t): (float(lp), rank)
            for rank, (t, lp) in enumerate(
                zip(result.top_token_ids[row][:k], result.top_logprobs[row][:k], strict=True), 1
            )
        }
        entries.setdefault(token, own or (float(result.logprobs[row]), int(result.ranks[row])))
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        return {t: Logprob(lp, rank, decode(t)) for t, (lp, rank) in entries.items()}

    def fail(self, request: Request, message: str, *, uncache: bool = False) -> None:
        request.error = message
        if request.is_finished:  # by the same step (EOS, length): its blocks are back, the error is what it ended in
            request.status = RequestStatus.FINISHED_ERROR
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, uncache=uncache)
        if (detok := self.detokenizers.get(request.request_id)) is not None:
            detok.finish()
            request.output_text += detok.get_delta()

    def outputs_of(self, requests) -> list[RequestOutput]:
        """One output for each group of `requests` still open (a group may have several of them)."""
        return self.outputs({r.output_key for r in requests if r.output_key in self.groups})

    def outputs(self, request_ids) -> list[RequestOutput]:
        return [self.output(rid) for rid in request_ids]

    def output(self, request_id: str) -> RequestOutput:
        samples = self.groups[request_id]
        finished = all(r.is_finished for r in samples)
        completions = []
        for r in samples:
            completions.append(
                CompletionOutput(
                    index=r.index,
                    text=r.output_text,
                    token_ids=list(r.output_token_ids),
                    cumulative_logprob=r.cumulative_logprob if r.sampling_params.logprobs is not None else None,
                    logprobs=list(r.logprobs) if r.sampling_params.logprobs is not None else None,
                    finish_reason=r.status.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        first = samples[0]
        errors = [r.error for r in samples if r.error]
        output = RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=first.metrics,
            error="; ".join(errors) or None,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=list(first.prompt_logprobs) if first.sampling_params.prompt_logprobs is not None else None,
            kv_transfer_params=first.kv_transfer_params,
        )
        if finished:
            del self.groups[request_id]
            for r in samples:
                self.detokenizers.pop(r.request_id, None)
                self.structured.free(r)
                if self.drafter is not None:
                    self.drafter.free(r.request_id)
        return output

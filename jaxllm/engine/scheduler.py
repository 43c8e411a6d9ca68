"""The scheduler: continuous batching with chunked prefill and preemption by recompute. Pure Python.

`schedule()` decides one step: running requests first — decodes before unfinished
prefills, so a long prompt never starves them — then waiting requests in policy order,
all within `max_num_batched_tokens` and `max_num_seqs`. When the KV pool runs dry, the
policy's victim is preempted: its blocks are freed and it returns to the waiting queue to
be recomputed. `update()` applies the sampled tokens and the token-level stop rules.

With a KV connector (kv_transfer/), a new request's prefix past the device cache's hits may come from outside:
loaded before its first step (synchronously), or while it waits in WAITING_FOR_REMOTE_KVS with its blocks
allocated (asynchronously; `finish_transfers` resumes it). Blocks a transfer still uses are held after their
request finished until the connector reports the transfer ended.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxllm.config import SchedulerConfig, SpeculativeConfig
from jaxllm.engine.drafts import add_drafts
from jaxllm.engine.in_flight import InFlightRequests, Pending
from jaxllm.engine.kv_cache_manager import NO_HIT, KVCacheManager
from jaxllm.engine.policy import make_waiting_queue
from jaxllm.request import Request, RequestStatus
from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput, max_logits_rows, request_rows
from jaxllm.spec_decode.budget import DraftBudget
from jaxllm.spec_decode.stats import SpecDecodingStats

if TYPE_CHECKING:
    import numpy as np

    from jaxllm.kv_transfer.base import FinishedTransfers, KVConnectorScheduler


class Scheduler:
    """With `speculative`, a running request's `draft_token_ids` (proposed after its last step) are verified as
    extra query rows, within a per-step cap (spec_decode/budget.py), the token budget, and `max_num_rows`
    rows of logits a step (`max_logits_rows`: k + 1 per sequence, as vLLM sizes them, so a full batch can
    verify drafts too). Requests and prompt scoring keep to `max_request_rows` of them (max(max_num_seqs,
    k + 1)): drafts get only the rows they leave.

    With `config.async_scheduling`, `schedule()` may run again before the previous step's `update()`: the
    engine launches step N+1 while step N is on the device. A request in step N follows it into step N+1
    only when its next input is known without step N's result (`InFlightRequests.may_follow`): the next chunk
    of its prompt, or, when step N samples its next token, that token as a placeholder the device fills in (positions,
    slots, kv_lens, seeds' step indices and the max_tokens / max_model_len checks all count it). Every
    other request in step N waits for it to be applied. While a step is unapplied nobody is preempted (a
    request that does not fit waits, and no new request starts this step).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        speculative: SpeculativeConfig | None = None,
        connector: KVConnectorScheduler | None = None,
        max_loras: int | None = None,
    ):
        self.config = config
        self.max_loras = max_loras  # LoRA: the most adapters running at once (their device slots); None: off
        self.kv = kv
        self.connector = connector
        self.waiting_for_remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS, by request id
        self._holding: dict[str, Request] = {}  # finished, blocks held for a transfer (KV connector)
        self._failed: list[Request] = []  # finished here with an error (a KV load): the engine reports them
        self.draft_budget, self.spec_stats = None, None
        self.max_num_rows = max_logits_rows(config, speculative)  # drafts included
        self.max_request_rows = request_rows(config, speculative)  # a row per request, prompt scoring's rows
        if speculative is not None:
            k = speculative.num_speculative_tokens
            self.draft_budget = DraftBudget(k, speculative.disable_by_batch_size)
            self.spec_stats = SpecDecodingStats(k)
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self.held: dict[str, list[Request]] = {}  # n > 1: siblings waiting for the first sample's prompt
        self.num_steps = 0
        self.num_preemptions = 0
        # steps launched before the previous one is applied: async scheduling, or a batch per pipeline stage
        self.async_scheduling = config.async_scheduling or config.max_concurrent_batches > 1
        if config.max_concurrent_batches > 1:  # each batch takes its share of the requests: the stages stay busy
            self.max_num_rows = -(-self.max_num_rows // config.max_concurrent_batches)
            self.max_request_rows = -(-self.max_request_rows // config.max_concurrent_batches)
        self.in_flight = InFlightRequests(config, speculative is not None)  # requests in unapplied steps

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def hold_siblings(self, first: Request, siblings: list[Request]) -> None:
        """Siblings start once `first` has computed the shared prompt, then share its blocks."""
        self.held[first.request_id] = siblings

    def finish_request(self, request: Request, status: RequestStatus, *, uncache: bool = False) -> None:
        """Finish a request in any state (stop, length, abort, error) and return its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and request in self.waiting:
            self.waiting.remove(request)
        loading = self.waiting_for_remote.pop(request.request_id, None) is not None
        request.status = status
        request.metrics.finished_time = time.monotonic()
        hold = False
        if self.connector is not None:
            hold, request.kv_transfer_params = self.connector.request_finished(
                request, self.kv.block_tables(request.request_id)
            )
        hold = hold or loading  # a load still writing into its blocks: they wait for it to end
        if hold:
            self._holding[request.request_id] = request
            if uncache:
                self.kv.uncache_from(request, 0)
        else:
            self.kv.free(request, uncache=uncache)
        if self.draft_budget is not None:
            self.draft_budget.forget(request.request_id)
        for sibling in self.held.pop(request.request_id, []):  # never started: finish them alike
            self.finish_request(sibling, status)

    @property
    def num_unfinished(self) -> int:
        held = sum(len(s) for s in self.held.values())
        return len(self.waiting) + len(self.running) + held + len(self.waiting_for_remote)

    # ---- KV connector ------------------------------------------------------------------------

    def finish_transfers(self, finished: FinishedTransfers) -> None:
        """Apply what the connector's runner half reports: loads done (the request may run), loads failed
        (`recompute` from the device cache's hits, or `fail` the request), sends done (held blocks go back)."""
        for rid in finished.received + list(finished.failed) + finished.sent:
            if (request := self._holding.pop(rid, None)) is not None:
                self.kv.free(request)
        for rid in finished.received:
            if (request := self.waiting_for_remote.pop(rid, None)) is not None:
                assert self.connector is not None
                self.connector.stats.external_prefix_cache_hits += request.num_external_tokens
                request.num_computed_tokens += request.num_external_tokens
                request.num_cached_tokens = request.num_computed_tokens
                self._resume(request)
        for rid, error in finished.failed.items():
            if (request := self.waiting_for_remote.pop(rid, None)) is None:
                continue
            assert self.connector is not None
            if self.connector.config.kv_load_failure_policy == "fail":
                self._fail(request, f"loading the prompt's KV failed: {error}")
            else:  # recompute: from the device cache's hits on
                self._resume(request)

    def _resume(self, request: Request) -> None:
        request.num_external_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.prepend(request)

    def _fail(self, request: Request, error: str) -> None:
        request.error = error
        self.finish_request(request, RequestStatus.FINISHED_ERROR, uncache=True)
        self._failed.append(request)

    @property
    def has_pending_transfers(self) -> bool:
        """Blocks are held for a transfer that has not ended: the engine must keep polling it."""
        return bool(self._holding)

    def take_failed(self) -> list[Request]:
        """Requests the scheduler finished with an error since the last call (their outputs are due)."""
        failed, self._failed = self._failed, []
        return failed

    def _external_tokens(self, request: Request, num_computed: int) -> tuple[int, bool] | None:
        """The connector's (tokens it can load after `num_computed`, asynchronously?), or None: the request
        failed (a load the `fail` policy will not recompute, or a producer whose KV does not fit)."""
        if self.connector is None or request.num_computed_tokens or request.sampling_params.prompt_logprobs is not None:
            return 0, False  # (a request scoring its prompt computes every position: nothing is loaded)
        self.connector.stats.external_prefix_cache_queries += request.num_tokens - num_computed
        try:
            return self.connector.get_num_new_matched_tokens(request, num_computed)
        except (ValueError, RuntimeError) as e:  # KVLoadError, KVScopeMismatch: this request only
            self.waiting.remove(request)
            self._fail(request, str(e))
            return None

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One step, in three phases: running requests, then waiting ones, then drafts in what is left."""
        out = SchedulerOutput(step=self.num_steps)
        self.num_steps += 1
        now = time.monotonic()
        budget, starved = self._schedule_running(out, self.config.max_num_batched_tokens, now)
        if not out.preempted and not starved:  # not while preempting (the pool is full), nor while one waits
            budget = self._schedule_waiting(out, budget, now)
        if self.draft_budget is not None and not out.preempted:  # never displacing a request
            add_drafts(out, budget, self.max_num_rows - out.num_rows, self.draft_budget, self.kv, self.config)
        if self.async_scheduling and out.scheduled:
            self.in_flight.launched(out)
        if self.connector is not None:  # evicted blocks out, loads in: before the step's forward
            out.kv_connector_metadata = self.connector.build_connector_meta(self.kv.take_evicted())
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> tuple[int, bool]:
        """Running requests, decodes first, then unfinished prefills; preempts the policy's victims when the pool
        runs dry. Returns the token budget left, and whether a request waits for an unapplied step's blocks."""
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        overlapping = self.in_flight.num_steps > 0  # async: the previous step is still on the device
        starved = False  # overlapping, a running request did not fit: it waits, and so do new requests
        for i, request in enumerate(order):
            if budget == 0 or out.num_rows >= self.max_request_rows:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            pending = self.in_flight.get(request) if overlapping else None
            if pending is not None and not self.in_flight.may_follow(request, pending):
                continue  # waits for its step's output
            done, placeholders = request.num_computed_tokens, 0
            if pending is not None:
                done += pending.tokens
                placeholders = pending.placeholders
            # the rows left after one for each running request not yet scheduled
            rows = max(self.max_request_rows - out.num_rows - (len(order) - i), 0)
            num_new = min(request.num_tokens + placeholders - done, budget)
            if _scores_prompt(request, done):
                num_new = min(num_new, rows + 1)
            if overlapping:  # no preemption while a step is unapplied: the request waits for the next step
                if not self.kv.allocate_slots(request, done - request.num_computed_tokens + num_new):
                    starved = True
                    continue
                self._schedule(out, request, num_new, now, done, placeholders, _prev_row(pending, placeholders))
                budget -= num_new
                continue
            while not self.kv.allocate_slots(request, num_new):
                scheduled = {id(s.request) for s in out.scheduled}
                candidates = [r for r in self.running if r is request or id(r) not in scheduled]
                victim = self.waiting.select_victim(candidates)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                self._schedule(out, request, num_new, now)
                budget -= num_new
        return budget, starved

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Waiting requests in policy order, each after its prefix-cache hits and what a KV connector loads.
        Returns the token budget left."""

        def room() -> bool:
            return budget > 0 and len(self.waiting) > 0 and len(self.running) < self.config.max_num_seqs

        if room():
            self.waiting.begin_step(self.kv)  # only when a request can start: lpm ranks by cache lookups
        adapters = self.running_adapters()
        while room() and out.num_rows < self.max_request_rows:
            request = self.waiting.peek()
            if not self.waiting.can_admit(request, self.running, self.kv):
                break
            adapter = request.lora_scope
            if adapter and adapter not in adapters:  # a further adapter waits for a slot, in policy order
                if self.max_loras is None or len(adapters) >= self.max_loras:
                    break
                adapters.add(adapter)
            # a request scoring its prompt computes every position, and so reads nothing from the prefix cache
            reads_cache = not request.num_computed_tokens and request.sampling_params.prompt_logprobs is None
            computed = self.kv.get_computed_blocks(request) if reads_cache else NO_HIT
            num_computed = request.num_computed_tokens + computed.num_blocks * self.kv.block_size
            external = self._external_tokens(request, num_computed)
            if external is None:
                continue  # failed
            num_external, load_async = external
            if load_async:  # blocks now, tokens once the load ends
                if not self.kv.allocate_slots(request, num_external, computed, num_external):
                    break
                self._wait_for_remote(request, num_computed, num_external)
                continue
            num_new = min(request.num_tokens - num_computed - num_external, budget)
            if _scores_prompt(request, num_computed):
                num_new = min(num_new, self.max_request_rows - out.num_rows)
            if not self.kv.allocate_slots(request, num_external + num_new, computed, num_external):
                break
            self.waiting.pop()
            if request.num_computed_tokens == 0 and request.num_preemptions == 0:
                request.num_cached_tokens = num_computed + num_external
            request.num_computed_tokens = num_computed
            if num_external:  # (the connector reads the device cache's hits off num_computed_tokens)
                assert self.connector is not None
                tables = self.kv.block_tables(request.request_id)
                self.connector.update_state_after_alloc(request, tables, num_external)
                self.connector.stats.external_prefix_cache_hits += num_external
                request.num_computed_tokens += num_external
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(out, request, num_new, now)
            budget -= num_new
        return budget

    def running_adapters(self) -> set[bytes]:
        """The LoRA adapters (scopes) of the running requests: each holds a device slot."""
        return {r.lora_scope for r in self.running if r.lora_scope}

    def _wait_for_remote(self, request: Request, num_computed: int, num_external: int) -> None:
        """The request's blocks are allocated; it waits, scheduling nothing, until its load ends."""
        assert self.connector is not None
        self.waiting.pop()
        request.num_computed_tokens = num_computed
        request.num_external_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[request.request_id] = request
        # its blocks' K/V is not there yet: nobody may hit them in the prefix cache until it is
        self.kv.uncache_from(request, num_computed // self.kv.block_size)
        self.connector.update_state_after_alloc(request, self.kv.block_tables(request.request_id), num_external)

    # ---- async scheduling: steps scheduled and not yet applied ---------------------------------

    def release(self, out: SchedulerOutput) -> None:
        """`out` is no longer in flight: applied (`update` calls this), or failed on the device."""
        if self.async_scheduling and out.scheduled:
            self.in_flight.released(out)

    def has_step_in_flight(self, request: Request) -> bool:
        return request in self.in_flight

    def _schedule(
        self,
        out: SchedulerOutput,
        request: Request,
        num_new: int,
        now: float,
        start: int | None = None,
        placeholders: int = 0,
        prev_row: int = -1,
    ) -> None:
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
        start = request.num_computed_tokens if start is None else start
        tables = self.kv.block_tables(request.request_id)
        scores = _scores_prompt(request, start)
        out.add(ScheduledRequest(request, num_new, start, tables, [], scores, 0, placeholders, prev_row))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # ---- after the step ----------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: Sequence[int] | np.ndarray) -> list[tuple[Request, int, int]]:
        """Advance each scheduled request; append the sampled tokens where they were due.

        `sampled`: a token per row of logits. A request that verified d drafts takes the rows' tokens while
        they equal its drafts, then the first that does not (or the bonus token after all d): exactly the
        tokens decoding one at a time would give from the same logits (each row's token is what the sampler
        draws at that output position). Its computed tokens roll back past the rejected drafts, whose KV
        slots later steps overwrite. Returns (request, first row, tokens appended) for each request that
        received tokens (finished ones included).
        """
        self.release(out)
        got_tokens = []
        for scheduled in out.scheduled:
            request, drafts, row = scheduled.request, scheduled.draft_token_ids, scheduled.sample_row
            if request.is_finished:  # aborted while the step ran (async: or stopped by the step before)
                continue
            accepted = 0
            while accepted < len(drafts) and int(sampled[row + accepted]) == drafts[accepted]:
                accepted += 1
            request.num_computed_tokens = scheduled.start + scheduled.num_new_tokens - len(drafts) + accepted
            if not scheduled.samples:
                self._computed(request)
                continue
            if request.sampling_params.max_tokens == 0:  # the prompt only (prompt_logprobs): no token
                self._computed(request)
                self.finish_request(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                got_tokens.append((request, row, 0))
                continue
            if drafts and self.spec_stats is not None and self.draft_budget is not None:
                self.spec_stats.observe(len(drafts), accepted)
                self.draft_budget.observe_verification(len(drafts), accepted, request.request_id)
            appended = 0
            for token in map(int, sampled[row : row + accepted + 1]):
                request.output_token_ids.append(token)
                appended += 1
                if self.held and appended == 1:
                    self._release_siblings(request)
                if (status := self._check_stop(request, token)) is None:
                    continue
                self._computed(request)  # (before its blocks go back)
                self.finish_request(request, status)
                break
            else:
                self._computed(request)
            got_tokens.append((request, row, appended))
        return got_tokens

    def _computed(self, request: Request) -> None:
        """Tell the KV connector which of the request's full blocks hold computed K/V of known tokens (never a
        draft: `num_computed_tokens` excludes rejected ones, and tokens past a stop are not the request's)."""
        if self.connector is None:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.kv.block_size
        if num_full:
            tables = self.kv.block_tables(request.request_id)
            self.connector.request_computed(request, tables, self.kv.block_hashes(request, num_full))

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _release_siblings(self, first: Request) -> None:
        """The first sample has its prompt's K/V: siblings share its full prompt blocks and join."""
        siblings = self.held.pop(first.request_id, None)
        if not siblings:
            return
        num_shared = (first.num_prompt_tokens - 1) // self.kv.block_size
        for sibling in siblings:
            self.kv.fork(first, sibling, num_shared)
            sibling.num_computed_tokens = num_shared * self.kv.block_size
            sibling.num_cached_tokens = sibling.num_computed_tokens
            self.waiting.prepend(sibling)


def _scores_prompt(request: Request, start: int) -> bool:
    """Whether a step from position `start` scores prompt tokens (prompt_logprobs; the first of n samples only)."""
    return (
        request.sampling_params.prompt_logprobs is not None
        and request.index == 0
        and start < request.num_prompt_tokens - 1
    )


def _prev_row(pending: Pending | None, placeholders: int) -> int:
    """The row of the unapplied step whose sampled token is the request's next input (-1: none)."""
    return pending.last.sample_row if pending is not None and placeholders else -1

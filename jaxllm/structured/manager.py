"""StructuredOutputManager: one llguidance matcher per constrained request.

Life of a constrained request (all on the engine thread, except compiling):
1. `add` — its grammar compiles on a thread pool (the LLTokenizer is built there too, once);
   the request waits here, outside the scheduler, while unconstrained requests keep running
   (vLLM's WAITING_FOR_FSM). Compiled grammars are cached by (kind, grammar text); each
   request gets a deep copy (~5 µs) of the cached, never-advanced matcher.
2. `take_compiled` — each step the engine moves compiled groups into the scheduler.
3. `fill_bitmask` — one llguidance batch call writes the masks of every constrained row that
   samples this step straight into the input batch's packed `allowed` rows (speculation: a row per
   draft too, each with the drafts before it consumed by a copy of the matcher; drafts were cut at
   the first token the grammar rejects, `valid_prefix`).
4. `advance` — each accepted token advances the matcher; at the grammar's end the engine
   finishes the request (finish_reason "stop"), so it never runs to max_tokens for lack of EOS.
5. `free` — a finished, aborted or failed request drops its matcher (and any pending compile).

With a reasoning parser, each matcher has a gate (reasoning/gate.py): the grammar starts after `</think>`.

Preemption needs nothing here: recompute keeps `output_token_ids`, and a matcher only ever
advances on tokens appended to them, so after recompute it is exactly where the request is.
"""

from __future__ import annotations

import concurrent.futures as futures
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.reasoning import Phase, ReasoningGate, ReasoningSyntax
from jaxllm.structured.tokenizer import llguidance_tokenizer, tokenizer_problem

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher

CACHE_SIZE = 256  # compiled grammars kept (LRU)
# llguidance's batch executor fills masks on ~80 % of the cores; with 2 cores or fewer that is one
# worker thread, and filling in the calling thread is faster (64 masks on a loaded 2-core machine:
# 7.6 vs 10.3 ms, and 1.0 vs 2.8 ms in a simpler JSON state; benchmarks/structured_cost.py --mask-only)
PARALLEL_FILL = (os.cpu_count() or 1) > 2


class StructuredOutputManager:
    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_workers: int | None = None,
        reasoning: ReasoningSyntax | None = None,
    ):
        self.unsupported = tokenizer_problem(hf_tokenizer)  # a reason, or None when usable
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers or min(4, os.cpu_count() or 1), thread_name_prefix="jaxllm-grammar")
        self._tokenizer: Future | None = None  # the LLTokenizer, built on first use
        self._executor: LLExecutor | None = None  # llguidance's batch mask executor, made on first use (PARALLEL_FILL)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pending: dict[str, tuple[list, Future]] = {}  # group id → (its requests, compiled matcher)
        self._matchers: dict[str, LLMatcher] = {}  # request id → its LLMatcher
        self.reasoning = reasoning  # the grammar waits for the reasoning's end (None: no reasoning parser)
        self._reasoning_ids = reasoning.token_ids(hf_tokenizer) if reasoning is not None else None
        self._gates: dict[str, ReasoningGate] = {}  # request id → where its reasoning stands
        self.fill_seconds = 0.0  # host time filling masks (cost accounting: benchmarks/structured_cost.py)
        self.advance_seconds = 0.0  # host time advancing matchers
        self.num_masks = 0

    # ---- compiling -------------------------------------------------------------------------

    def add(self, group_id: str, requests: list) -> None:
        """Start compiling the grammar shared by `requests` (one user request's samples)."""
        self._pending[group_id] = (requests, self._compiled(requests[0].sampling_params.structured_outputs))

    def _compiled(self, params) -> Future:
        key = (params.kind, params.llguidance_grammar)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._tokenizer is None:
            self._tokenizer = self._pool.submit(
                llguidance_tokenizer, self._hf_tokenizer, self.vocab_size, self.eos_token_ids
            )
        future = self._pool.submit(self._compile, params.llguidance_grammar)
        self._cache[key] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, grammar: str) -> LLMatcher:
        import llguidance

        assert self._tokenizer is not None, "compile submits the tokenizer's build before any grammar"
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile for this tokenizer: {matcher.get_error()}")
        return matcher

    def take_compiled(self) -> list[tuple[list, str | None]]:
        """Groups whose grammar is ready, in arrival order, each with None or the compile error.

        Ready groups have their matchers from here on; failed ones are forgotten (their failure
        stays cached: the same grammar fails the same way).
        """
        done: list[tuple[list, str | None]] = []
        for group_id, (requests, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[group_id]
            try:
                template = future.result()
            except Exception as e:  # noqa: BLE001 — reported on the request, never raised into the loop
                done.append((requests, f"structured outputs: {e}"))
                continue
            for request in requests:
                self._matchers[request.request_id] = template.deep_copy()
                if self.reasoning is not None and self._reasoning_ids is not None:
                    self._gates[request.request_id] = ReasoningGate(
                        self.reasoning, *self._reasoning_ids, request.prompt_token_ids
                    )
            done.append((requests, None))
        return done

    def wait(self, timeout: float) -> None:
        """Block until a pending grammar compiles (or `timeout`): an idle engine waits, never spins."""
        if self._pending:
            futures.wait([f for _, f in self._pending.values()], timeout, futures.FIRST_COMPLETED)

    # ---- per step --------------------------------------------------------------------------

    def fill_bitmask(self, scheduled, allowed: np.ndarray) -> list[int]:
        """Write the grammar masks of rows that sample this step into `allowed` (uint32 [rows, W]).

        One llguidance batch call (parallel over cores, GIL released) for requests without drafts. A request
        verifying d drafts has d + 1 rows: row j's mask is the grammar's after drafts 0..j-1 (consumed by a
        copy of its matcher). Returns the rows written.
        """
        if not self._matchers:
            return []
        start = time.perf_counter()
        rows, written, may_open = [], [], []
        for s in scheduled:
            matcher = self._matchers.get(s.request.request_id)
            if matcher is None or not s.samples:
                continue
            gate = self._gates.get(s.request.request_id)
            first = gate.answer_start(s.draft_token_ids) if gate is not None else 0
            if first is None:
                continue  # thinking, drafts included: no mask
            if s.draft_token_ids:  # the drafts may end the reasoning: the rows after the end tag are the grammar's
                self._check(allowed)
                written += self._fill_drafted(matcher, s.logits_row + first, s.draft_token_ids[first:], allowed)
            else:
                rows.append((matcher, s.sample_row))
                if gate is not None and gate.phase is Phase.MAY_OPEN:
                    may_open.append((s.sample_row, gate.start_id))
        if rows:
            self._check(allowed)
            self._fill_rows(rows, allowed)
            written += [row for _, row in rows]
        for row, token in may_open:  # the output's first token may open the reasoning instead
            allowed[row, token // 32] |= np.uint32(1 << (token % 32))
        self.num_masks += len(written)
        self.fill_seconds += time.perf_counter() - start
        return written

    def _check(self, allowed: np.ndarray) -> None:
        if allowed.dtype != np.uint32 or not allowed.flags.c_contiguous or allowed.shape[1] * 32 < self.vocab_size:
            raise ValueError(f"allowed must be C-contiguous uint32 [rows, >= {-(-self.vocab_size // 32)}]")

    def _fill_drafted(self, matcher, row: int, drafts: list[int], allowed: np.ndarray) -> list[int]:
        """Row `row + j`: the mask after drafts 0..j-1, consumed by a copy of the matcher (~1-5 µs). Not by the
        matcher itself and a rollback: at the grammar's end llguidance takes EOS without recording it, so a
        rollback by the drafts' count fails and leaves the matcher in its error state for good."""
        stride = allowed.shape[1] * 4
        matcher.unsafe_compute_mask_ptr(allowed.ctypes.data + row * stride, stride)
        ahead = matcher.deep_copy()
        for j, token in enumerate(drafts, 1):
            if not ahead.consume_token(token):
                raise ValueError(f"draft token {token} does not fit the grammar: {ahead.get_error()}")
            ahead.unsafe_compute_mask_ptr(allowed.ctypes.data + (row + j) * stride, stride)
        return list(range(row, row + len(drafts) + 1))

    def _fill_rows(self, rows: list, allowed: np.ndarray) -> None:
        stride = allowed.shape[1] * 4
        if PARALLEL_FILL:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(rows, allowed.ctypes.data, stride, allowed.shape[0])
        else:  # each call releases the GIL; a worker thread would only add hand-offs
            base = allowed.ctypes.data
            for matcher, row in rows:
                matcher.unsafe_compute_mask_ptr(base + row * stride, stride)

    def advance(self, request, token: int) -> bool:
        """Feed one accepted token to the request's matcher; True when the grammar has ended.

        False for unconstrained requests. A token the grammar rejects raises ValueError.
        """
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            return False
        gate = self._gates.get(request.request_id)
        if gate is not None and not gate.feeds_grammar(token):
            return False
        start = time.perf_counter()
        try:
            if not matcher.consume_token(token):
                raise ValueError(f"token {token} does not fit the grammar: {matcher.get_error()}")
            return matcher.is_stopped()
        finally:
            self.advance_seconds += time.perf_counter() - start

    def valid_prefix(self, request, tokens: list[int]) -> int:
        """How many leading `tokens` the request's grammar accepts from where it is (all, when unconstrained)."""
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            return len(tokens)
        gate = self._gates.get(request.request_id)
        if gate is None or gate.phase is Phase.ANSWER:
            return matcher.validate_tokens(tokens)
        if gate.phase is Phase.MAY_OPEN:
            return 0  # no drafts for an output's first token
        first = gate.answer_start(tokens)
        return len(tokens) if first is None else first + matcher.validate_tokens(tokens[first:])

    def free(self, request) -> None:
        self._matchers.pop(request.request_id, None)
        self._gates.pop(request.request_id, None)
        self._pending.pop(request.output_key, None)

    # ---- introspection ---------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._matchers)

    @property
    def num_pending(self) -> int:
        return sum(len(requests) for requests, _ in self._pending.values())

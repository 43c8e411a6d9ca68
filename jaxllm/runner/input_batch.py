"""Host-side arrays for the next step, allocated once at the largest bucket and reused.

`InputBatch.fill` packs a `SchedulerOutput` into the flattened ragged layout of
docs/design.md, padded to a bucket: padding tokens write to the scratch slot 0, padding
sequences have no tokens and no context, and padding sampling rows are greedy.

Async scheduling: a scheduled request's last input token may be a placeholder for the token the
previous, still unapplied step samples (`ScheduledRequest.num_placeholders`); its `token_ids` entry is
0 and `src` holds the previous step's sampler row, which the compiled step gathers on the device
(`src` is -1 wherever the host knows the token). Its sampling row counts the placeholder among the
outputs (the seed's step index, min_tokens). The scheduler keeps every request whose sampler inputs
need the unknown token out of such a step (engine/in_flight.py, `may_follow`, lists the rule per input).
"""

from __future__ import annotations

import numpy as np

from jaxllm.kv_cache_groups import SCRATCH_BLOCK
from jaxllm.model import StepInputs
from jaxllm.runner.buckets import Bucket
from jaxllm.runner.sampler import SamplingInputs
from jaxllm.runner.token_masks import ban_tokens
from jaxllm.sampling_params import MAX_LOGIT_BIAS
from jaxllm.scheduler_output import SchedulerOutput


class InputBatch:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        vocab_size: int,
        block_size: int,
        num_groups: int = 1,
    ):
        self.block_size = block_size
        i32, f32 = np.int32, np.float32
        self.token_ids = np.zeros(max_tokens, i32)
        self.src = np.full(max_tokens, -1, i32)  # async: previous step's sampler row giving the token, or -1
        self.positions = np.zeros(max_tokens, i32)
        self.slot_mapping = np.zeros((num_groups, max_tokens), i32)  # per KV cache group
        self.cu_q_lens = np.zeros(max_seqs + 1, i32)
        self.kv_lens = np.zeros(max_seqs, i32)
        self.block_tables = np.zeros((num_groups, max_seqs, max_blocks_per_seq), i32)
        self.logits_indices = np.zeros(max_seqs, i32)
        self.num_seqs = np.zeros(1, i32)
        self.temperature = np.zeros(max_seqs, f32)
        self.top_k = np.zeros(max_seqs, i32)
        self.top_p = np.ones(max_seqs, f32)
        self.min_p = np.zeros(max_seqs, f32)
        self.repetition_penalty = np.ones(max_seqs, f32)
        self.presence_penalty = np.zeros(max_seqs, f32)
        self.frequency_penalty = np.zeros(max_seqs, f32)
        self.seeds = np.zeros(max_seqs, i32)
        self.steps = np.zeros(max_seqs, i32)
        self.history = np.full((max_seqs, max_model_len), -1, i32)
        self.prompt_lens = np.zeros(max_seqs, i32)
        self.all_allowed = np.full(-(-vocab_size // 32), 0xFFFFFFFF, np.uint32)
        self.allowed = np.tile(self.all_allowed, (max_seqs, 1))
        self.num_logprobs = np.full(max_seqs, -1, i32)
        self.target_ids = np.full(max_seqs, -1, i32)
        self.bias_ids = np.full((max_seqs, MAX_LOGIT_BIAS), -1, i32)
        self.bias_values = np.zeros((max_seqs, MAX_LOGIT_BIAS), f32)
        self._biased_rows: set[int] = set()
        self._history_rows: set[int] = set()  # rows to clear before reuse
        self._masked_rows: set[int] = set()

    def fill(
        self, out: SchedulerOutput, bucket: Bucket, grammar=None
    ) -> tuple[StepInputs[np.ndarray], SamplingInputs[np.ndarray]]:
        T, S = bucket.num_tokens, bucket.num_seqs
        bs = self.block_size
        self._reset_sampling_rows(S)
        if grammar is not None:  # grammar masks first: the min_tokens bans below narrow them further
            self._masked_rows.update(grammar.fill_bitmask(out.scheduled, self.allowed))
        self.block_tables[:, :S] = SCRATCH_BLOCK
        self.src[:T] = -1
        num_tokens = 0
        for seq, scheduled in enumerate(out.scheduled):
            request, start, n = scheduled.request, scheduled.start, scheduled.num_new_tokens
            drafts, row = scheduled.draft_token_ids, scheduled.logits_row
            end, d = num_tokens + n, len(drafts)
            positions = np.arange(start, start + n, dtype=np.int32)
            if scheduled.num_placeholders:  # a decode whose input token the previous step samples
                assert n == 1 and not d and scheduled.prev_row >= 0, "a placeholder is a decode's only token"
                self.token_ids[num_tokens] = 0
                self.src[num_tokens] = scheduled.prev_row
            else:
                self.token_ids[num_tokens : end - d] = _token_slice(request, start, start + n - d)
            self.token_ids[end - d : end] = drafts
            self.positions[num_tokens:end] = positions
            for group, table in enumerate(scheduled.block_ids):
                blocks = np.asarray(table, np.int32)
                self.slot_mapping[group, num_tokens:end] = blocks[positions // bs] * bs + positions % bs
                self.block_tables[group, seq, : len(blocks)] = blocks
            self.kv_lens[seq] = start + n
            self.cu_q_lens[seq + 1] = end
            if scheduled.scores_prompt:  # a row per token, each scoring the next prompt token (the last may sample)
                self.logits_indices[row : row + n] = np.arange(num_tokens, end, dtype=np.int32)
                for j in range(n - 1 if scheduled.samples else n):
                    self._fill_scoring_row(row + j, request, request.prompt_token_ids[start + j + 1])
                if scheduled.samples:
                    self._fill_sampling_row(row + n - 1, request)
            ahead = scheduled.num_placeholders
            for j in range(0 if scheduled.scores_prompt else d + 1):  # the last token's row, then one per draft
                self.logits_indices[row + j] = end - 1 - d + j
                self._fill_sampling_row(row + j, request, ahead=ahead + j)
            num_tokens = end
        num_seqs = len(out.scheduled)
        self.token_ids[num_tokens:T] = 0
        self.positions[num_tokens:T] = 0
        self.slot_mapping[:, num_tokens:T] = SCRATCH_BLOCK * bs
        self.cu_q_lens[0] = 0
        self.cu_q_lens[num_seqs + 1 : S + 1] = num_tokens
        self.kv_lens[num_seqs:S] = 0
        self.logits_indices[out.num_rows : S] = 0
        self.num_seqs[0] = num_seqs
        inputs = StepInputs(
            self.token_ids[:T],
            self.positions[:T],
            self.slot_mapping[:, :T],
            self.cu_q_lens[: S + 1],
            self.kv_lens[:S],
            self.block_tables[:, :S],
            self.num_seqs,
            self.logits_indices[:S],
        )
        sampling = SamplingInputs(
            self.temperature[:S],
            self.top_k[:S],
            self.top_p[:S],
            self.min_p[:S],
            self.repetition_penalty[:S],
            self.presence_penalty[:S],
            self.frequency_penalty[:S],
            self.seeds[:S],
            self.steps[:S],
            self.history[:S],
            self.prompt_lens[:S],
            self.allowed[:S],
            self.num_logprobs[:S],
            self.bias_ids[:S],
            self.bias_values[:S],
            self.target_ids[:S],
        )
        return inputs, sampling

    def _reset_sampling_rows(self, num_rows: int) -> None:
        self.temperature[:num_rows] = 0
        self.top_k[:num_rows] = 0
        self.top_p[:num_rows] = 1
        self.min_p[:num_rows] = 0
        self.repetition_penalty[:num_rows] = 1
        self.presence_penalty[:num_rows] = 0
        self.frequency_penalty[:num_rows] = 0
        self.seeds[:num_rows] = 0
        self.steps[:num_rows] = 0
        self.prompt_lens[:num_rows] = 0
        self.num_logprobs[:num_rows] = -1
        self.target_ids[:num_rows] = -1
        for row in self._history_rows:
            self.history[row] = -1
        for row in self._masked_rows:
            self.allowed[row] = self.all_allowed
        for row in self._biased_rows:
            self.bias_ids[row] = -1
            self.bias_values[row] = 0
        self._history_rows.clear()
        self._masked_rows.clear()
        self._biased_rows.clear()

    def _fill_scoring_row(self, row: int, request, target: int) -> None:
        """A row that scores prompt token `target`: its raw logprob and rank, and the top prompt_logprobs."""
        self.target_ids[row] = target
        self.num_logprobs[row] = request.sampling_params.prompt_logprobs

    def _fill_sampling_row(self, row: int, request, ahead: int = 0) -> None:
        """`ahead`: the row samples the output token that many after the next one the host knows of
        (speculation's rows; async scheduling's placeholder)."""
        p = request.sampling_params
        num_output = request.num_output_tokens + ahead
        self.temperature[row] = p.temperature
        self.top_k[row] = max(p.top_k, 0)
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.seeds[row] = request.sample_seed
        self.steps[row] = num_output
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        if p.uses_penalties:
            self.repetition_penalty[row] = p.repetition_penalty
            self.presence_penalty[row] = p.presence_penalty
            self.frequency_penalty[row] = p.frequency_penalty
            tokens = request.all_token_ids
            self.history[row, : len(tokens)] = tokens
            self.prompt_lens[row] = request.num_prompt_tokens
            self._history_rows.add(row)
        if p.logit_bias:
            self.bias_ids[row, : len(p.logit_bias)] = list(p.logit_bias)
            self.bias_values[row, : len(p.logit_bias)] = list(p.logit_bias.values())
            self._biased_rows.add(row)
        if num_output < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(request.eos_token_ids))
            if banned:
                ban_tokens(self.allowed[row], banned)
                self._masked_rows.add(row)


def _token_slice(request, start: int, end: int) -> list[int]:
    prompt, output = request.prompt_token_ids, request.output_token_ids
    n = len(prompt)
    if start >= n:
        return output[start - n : end - n]
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[: end - n]

"""The draft-model proposer: a smaller model with the target's vocabulary drafts k tokens greedily.

It runs in the engine's process on a `Worker` of its own (weights, paged KV cache, compiled buckets like the
target's) and keeps its own block bookkeeping: a shadow request per target request, whose blocks are freed
with it. Each engine step it first feeds every drafting request the tokens the target accepted since its last
draft (a whole prompt the first time, in chunks of `max_num_batched_tokens`), whose last logits give draft 0,
then k - 1 steps of one token each. Drafts are greedy, so the draft distribution q is one-hot and the target's
verification (sample each row, keep drafts while they match) is exact rejection sampling.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from jaxllm.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.request import Request
from jaxllm.runner.kv_cache import bytes_per_block
from jaxllm.runner.worker import Worker
from jaxllm.sampling_params import SamplingParams
from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxllm.weights import open_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def draft_engine_config(target: EngineConfig, draft_model: str, num_target_blocks: int, arch, dtype) -> EngineConfig:
    """The target's limits (buckets, max_model_len) with the draft's model, and a KV cache of as many tokens."""
    model = dataclasses.replace(target.model, model=draft_model, tokenizer=None)
    cache = dataclasses.replace(
        target.cache,
        kv_cache_memory_bytes=num_target_blocks * bytes_per_block(arch, target.cache.block_size, dtype),
        cache_dtype="auto",
        enable_prefix_caching=False,
    )
    scheduler = dataclasses.replace(target.scheduler, async_scheduling=False)  # the drafter's steps are synchronous
    return dataclasses.replace(target, model=model, cache=cache, scheduler=scheduler, speculative=None)


class DraftModelProposer:
    def __init__(
        self,
        config: SpeculativeConfig,
        target: EngineConfig,
        target_vocab_size: int,
        num_target_blocks: int,
        mesh: Mesh,
        *,
        executable_dir: str | None = None,
        progress: bool = True,
    ):
        assert config.model is not None, "SpeculativeConfig checks that draft_model has a model"
        model: ModelConfig = target.model
        source = open_model(
            config.model, load_format=model.load_format, dtype=model.dtype, quantization=model.quantization
        )
        if source.arch.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config: the draft model {config.model} has a vocabulary of {source.arch.vocab_size} "
                f"tokens, the target {target_vocab_size}: a draft model must share the target's vocabulary"
            )
        max_len = source.arch.max_position_embeddings
        if max_len < target.scheduler.max_model_len:
            raise ValueError(
                f"speculative_config: the draft model {config.model} takes {max_len} positions, fewer than "
                f"max_model_len={target.scheduler.max_model_len}"
            )
        self.config = draft_engine_config(target, config.model, num_target_blocks, source.arch, source.dtype)
        self.worker = Worker(
            source, self.config, mesh, seed=model.seed, executable_dir=executable_dir, progress=progress
        )
        cache: CacheConfig = self.config.cache
        runner = self.worker.runner
        self.kv = KVCacheManager(
            runner.num_blocks, cache.block_size, enable_prefix_caching=False, windows=runner.kv_groups.windows
        )
        self._shadows: dict[str, Request] = {}  # target request id → the draft's copy (its KV, its drafts)

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        """Up to k greedy draft tokens for each request (none for one the draft's KV pool cannot hold)."""
        live = {r.request_id for r in requests}
        for request_id in [rid for rid in self._shadows if rid not in live]:  # not drafting now: free its blocks
            self.free(request_id)
        shadows = [self._sync(r) for r in requests]
        drafting = self._catch_up(shadows)
        for _ in range(k - 1):
            drafting = self._step([(s, 1) for s in drafting])[1]
        drafts = []
        for request, shadow in zip(requests, shadows, strict=True):
            drafts.append(shadow.output_token_ids[request.num_output_tokens :][:k])
            del shadow.output_token_ids[request.num_output_tokens :]  # the draft's KV of real tokens stays valid
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, request.num_tokens)
        return drafts

    def _sync(self, request: Request) -> Request:
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, list(request.prompt_token_ids), GREEDY)
            self._shadows[request.request_id] = shadow
        shadow.output_token_ids.extend(request.output_token_ids[shadow.num_output_tokens :])
        return shadow

    def _catch_up(self, shadows: list[Request]) -> list[Request]:
        """Feed each shadow its tokens not yet in the draft's cache; the chunk that reaches the end samples draft 0.
        Returns the shadows that drafted."""
        budget_per_step = self.config.scheduler.max_num_batched_tokens
        pending, drafted = list(shadows), []
        while pending:
            chunks, budget = [], budget_per_step
            for shadow in pending:
                n = min(shadow.num_tokens - shadow.num_computed_tokens, budget)
                if n > 0:
                    chunks.append((shadow, n))
                    budget -= n
            fed, sampled = self._step(chunks)
            drafted += sampled
            refused = {id(s) for s, _ in chunks} - {id(s) for s in fed}  # no room in the draft's pool: no drafts
            pending = [s for s in pending if s not in sampled and id(s) not in refused]
        return drafted

    def _step(self, chunks: list[tuple[Request, int]]) -> tuple[list[Request], list[Request]]:
        """One draft-model step over `chunks` (shadow, tokens to feed). Returns the shadows fed, and those that
        fed their last token and so got the sampled token appended."""
        out = SchedulerOutput(step=-1)
        for shadow, n in chunks:
            if self.kv.allocate_slots(shadow, n):
                tables = self.kv.block_tables(shadow.request_id)
                out.add(ScheduledRequest(shadow, n, shadow.num_computed_tokens, tables))
        if out.is_empty:
            return [], []
        result = self.worker.runner.execute(out)
        sampled = []
        for scheduled in out.scheduled:
            shadow = scheduled.request
            shadow.num_computed_tokens += scheduled.num_new_tokens
            if scheduled.samples:
                shadow.output_token_ids.append(int(result.token_ids[scheduled.logits_row]))
                sampled.append(shadow)
        return [s.request for s in out.scheduled], sampled

    def free(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

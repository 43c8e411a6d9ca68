"""EngineCore: the step loop that ties scheduler, model runner and detokenizer together.

`add_request` validates at the boundary (a bad request raises `ValueError` and changes
nothing); `step()` schedules, runs one compiled step, applies the sampled tokens and
returns a `RequestOutput` for every request that progressed. A failure inside one
request's post-processing finishes only that request (finish_reason "error"); a failed
device step finishes only the requests it carried. Their blocks always return to the pool.

With async scheduling (`EngineArgs.async_scheduling`) or pipeline stages, `step()` schedules and launches
step N+1 before it applies step N (engine/step_loop.py: one loop, its depth the steps in flight); a call may
return the outputs of the step before the one it launched, and `has_unfinished_requests()` stays true until
the last launched step is applied.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import jax.numpy as jnp

from jaxllm.distributed.runtime import initialize_from_args
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.startup import check_layout, check_prompt, enable_compilation_cache, log_ready
from jaxllm.engine.step_loop import InFlightStep, StepLoop
from jaxllm.kv_events.publisher import make_kv_events
from jaxllm.kv_transfer.factory import KVConnector, check_kv_connector, make_kv_connector
from jaxllm.kv_transfer.scope import KVScope
from jaxllm.lora.manager import LoRAManager
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.parallel.mesh import make_mesh
from jaxllm.pooling.accumulate import PoolingAccumulator
from jaxllm.pooling.config import check_dimensions, resolve_pooler
from jaxllm.pooling.params import PoolingParams
from jaxllm.reasoning import resolve_reasoning_parser
from jaxllm.request import Request, RequestStatus
from jaxllm.runner.kv_blocks import KVBlockMover
from jaxllm.runner.kv_cache import bytes_per_block, kv_cache_groups
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.runner.worker import Worker
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.scheduler_output import SchedulerOutput
from jaxllm.spec_decode.drafter import make_drafter
from jaxllm.structured.manager import StructuredOutputManager
from jaxllm.weights import LoadedModel, open_model

logger = logging.getLogger("jaxllm")


class EngineCore:
    def __init__(self, args: EngineArgs, *, progress: bool = True):
        started = time.perf_counter()
        args.check()  # every setting that needs no model, before anything loads
        speculative, kv_transfer = args.speculative(), args.kv_transfer()
        cache_folder = enable_compilation_cache(args.compilation_cache_dir)
        if args.data_parallel_size != 1:  # LLM and the server run replicas through a DP client instead
            raise ValueError("data_parallel_size > 1 is not supported yet")
        initialize_from_args(args)  # multi-host: join the other nodes first (the mesh spans them all)
        mesh = make_mesh(args.tensor_parallel_size, args.data_parallel_size)
        source = open_model(
            args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            quantization=args.quantization,
            tensor_parallel_size=args.tensor_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
        )
        arch = source.arch
        check_layout(arch, args.tensor_parallel_size, args.pipeline_parallel_size)
        if args.enable_lora and arch.moe is not None:
            raise ValueError(f"enable_lora is not supported for mixture-of-experts models ({arch.architecture}) yet")
        self.config = args.create_engine_config(arch.max_position_embeddings, jax.default_backend())
        if self.config.runner == "pooling":  # the pooler: given, the model's sentence-transformers files, or LAST
            pooler = resolve_pooler(self.config.pooler, source.path, source.hf_config)
            self.config = dataclasses.replace(self.config, pooler=pooler)
            logger.info("pooling runner: %s pooling, normalize=%s", pooler.pooling_type, pooler.normalize)
        # the pooling runner's host side: chunk sums → embeddings, and each pooling request's params
        self.pooler = PoolingAccumulator(self.config.pooler) if self.config.pooler is not None else None
        self._pooling_params: dict[str, PoolingParams] = {}
        if kv_transfer is not None:  # its sizes against memory, before anything loads
            kv_dtype = self.config.cache.kv_dtype(source.dtype)
            slots = kv_cache_groups(arch, self.config).slots  # (a block holds one group's layers)
            check_kv_connector(kv_transfer, bytes_per_block(arch, self.config.cache.block_size, kv_dtype, slots=slots))
        self.seed = args.seed
        executables = os.path.join(cache_folder, "jaxllm-executables") if cache_folder else None
        if os.environ.get("JAXLLM_DISABLE_EXECUTABLE_CACHE", "0") not in ("", "0"):  # vLLM's VLLM_DISABLE_COMPILE_CACHE
            executables = None  # (JAX's cache stays on: each step is traced and lowered, then its compile served)
        # the device side: the target model's worker (weights, KV cache, compiled steps), a draft model's too
        self.worker = Worker(
            source,
            self.config,
            mesh,
            tokenizer=args.tokenizer,
            seed=args.seed,
            executable_dir=executables,
            progress=progress,
        )
        # the host side: blocks (hashed within the KV's scope), scheduling, text, grammars, drafts, KV transfers
        block_size = self.config.cache.block_size
        self.kv_scope = self._kv_scope(args)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            block_size,
            self.config.cache.enable_prefix_caching,
            root=self.kv_scope.root,
            record_evictions=kv_transfer is not None and kv_transfer.records_evictions,
            windows=self.runner.kv_groups.windows,
        )
        # KV events: what the prefix cache stores and drops, one batch per step (kv_events/)
        self.kv_events_config = args.kv_events()
        self.kv_events = make_kv_events(self.kv_events_config, block_size=block_size, scope=self.kv_scope.root.hex())
        self.kv.listener = self.kv_events
        self.kv_connector: KVConnector | None = None
        if kv_transfer is not None:
            mover = KVBlockMover(self.runner, self.runner.max_blocks_per_request)
            mover.warm_up()
            self.kv_connector = make_kv_connector(kv_transfer, self.kv_scope, self.kv, mover)
            self.worker.attach_kv_connector(self.kv_connector.worker)
            logger.info("KV connector %s (%s) ready", kv_transfer.kv_connector, kv_transfer.kv_role)
        connector = self.kv_connector.scheduler if self.kv_connector is not None else None
        lora = self.config.lora
        self.lora = LoRAManager(lora, arch, self.runner.prepare_lora, self.runner.load_lora) if lora else None
        max_loras = lora.max_loras if lora is not None else None
        self.scheduler = Scheduler(self.config.scheduler, self.kv, speculative, connector, max_loras)
        self.tokenizer = self.loaded.tokenizer
        eos = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        if jax.process_count() > 1 and jax.process_index() == 0:  # multi-host: node 0 drives the followers
            self.worker.lead_followers(args.distributed_timeout)
        depth = self.config.scheduler.max_steps_in_flight
        self.loop = StepLoop(self.scheduler, self._launch, self._apply, depth)
        self._next_seed = 0
        self.reasoning = resolve_reasoning_parser(self.config.reasoning_parser, self.tokenizer)
        self.structured = StructuredOutputManager(
            self.tokenizer, arch.vocab_size, self.eos_token_ids, reasoning=self.reasoning
        )
        self.drafter = make_drafter(
            speculative, self.scheduler, self.config, arch.vocab_size, mesh, executables, progress
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.structured, self.drafter)
        self.startup_seconds = time.perf_counter() - started
        self.startup_phases = {**self.worker.startup_phases, "total": self.startup_seconds}
        log_ready(self, cache_folder)

    @property
    def runner(self) -> ModelRunner:
        return self.worker.runner

    def _kv_scope(self, args: EngineArgs) -> KVScope:
        """What another engine's KV must match to be used here (kv_transfer/scope.py)."""
        arch = self.loaded.arch
        return KVScope(
            model=self.loaded.name,
            quantization=self.loaded.quant.describe(),
            dtype=self.loaded.dtype.name,
            kv_cache_dtype=jnp.dtype(self.config.cache.kv_dtype(self.loaded.dtype)).name,
            block_size=self.config.cache.block_size,
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            tensor_parallel_size=args.tensor_parallel_size,
            kv_cache_groups=self.runner.kv_groups.key,
        )

    @property
    def loaded(self) -> LoadedModel:
        return self.worker.loaded

    # ---- requests --------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        check_prompt(prompt_token_ids, self.config.scheduler.max_model_len, self.loaded.arch.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        user: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """`params`: a SamplingParams (runner "generate") or a PoolingParams (runner "pooling", vLLM's rule: an
        embedding request is a prefill-only request whose output carries `embedding`)."""
        if self.pooler is not None and params is None:
            params = PoolingParams()
        pooling = self._check_runner(params)
        if pooling is not None:
            if request_id in self.output_processor.groups:
                raise ValueError(f"request id {request_id!r} is already in use")
            assert self.pooler is not None  # (`_check_runner` refuses PoolingParams on a generate engine)
            check_dimensions(self.pooler.pooler, pooling.dimensions, self.loaded.arch.hidden_size)
            # the prompt only, no token: the scheduler finishes it after its last chunk and frees its blocks
            params = SamplingParams(max_tokens=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.output_processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = [int(t) if hasattr(t, "__index__") else t for t in prompt_token_ids]
        self.validate_prompt(prompt_token_ids)
        vocab = self.loaded.arch.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not below the vocabulary size {vocab}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if params.structured_outputs is not None and self.structured.unsupported:
            raise ValueError(self.structured.unsupported)
        if params.kv_transfer_params and self.kv_connector is not None:  # a producer's params that cannot work here
            self.kv_connector.scheduler.check_request(params.kv_transfer_params)
        lora_scope = self._lora_scope(lora_request)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        samples = []
        for index in range(params.n):
            child = params.for_child(index) if params.n > 1 else params
            request = Request(
                request_id if params.n == 1 else f"{index}_{request_id}",
                list(prompt_token_ids),
                child,
                self.eos_token_ids,
                prompt=prompt,
                priority=priority,
                arrival_time=arrival,
                index=index,
                user=user,
                parent_id=request_id if params.n > 1 else None,
                sample_seed=child.seed if child.seed is not None else self._fresh_seed(),
                lora_request=lora_request,
                lora_scope=lora_scope,
            )
            samples.append(request)
        self.output_processor.add(request_id, samples)
        if pooling is not None:
            self._pooling_params[request_id] = pooling
        if params.structured_outputs is not None:  # waits outside the scheduler until its grammar compiled
            for request in samples:
                request.status = RequestStatus.WAITING_FOR_FSM
            self.structured.add(request_id, samples)
        else:
            self._schedule_group(samples)

    def _check_runner(self, params) -> PoolingParams | None:
        """The request's PoolingParams (None: a generate request); a request of the other runner's kind is a
        ValueError naming `runner`."""
        if isinstance(params, PoolingParams):
            if self.pooler is None:
                raise ValueError(
                    "this engine runs runner='generate': embedding and scoring need runner='pooling' (--runner pooling)"
                )
            return params
        if self.pooler is not None:
            raise ValueError(
                "this engine runs runner='pooling' (embeddings, scores): generating needs runner='generate' "
                "(--runner generate)"
            )
        return None

    def _embeddings(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Pooling requests that finished: their embedding from the accumulated rows (a failed or aborted one's
        rows are dropped). Other outputs pass as they are."""
        if self.pooler is None:
            return outputs
        for out in outputs:
            if not out.finished or (params := self._pooling_params.pop(out.request_id, None)) is None:
                continue
            reason = out.outputs[0].finish_reason if out.outputs else None
            if out.error is None and reason == "length":  # (the prompt ran to its end)
                out.embedding = self.pooler.finish(out.request_id, len(out.prompt_token_ids), params)
            else:
                self.pooler.drop(out.request_id)
        return outputs

    def _lora_scope(self, lora_request: LoRARequest | None) -> bytes:
        """The adapter's scope (read and checked on first use: ValueError), b"" without one."""
        if lora_request is None:
            return b""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError("a request with a LoRA adapter needs enable_lora=True (--enable-lora)")
        return self.lora.add(lora_request)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ---------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (ValueError, FileNotFoundError), so its first request does not."""
        self._lora_scope(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already running with it finish with it. False: unknown (or LoRA off)."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.lora.adapters.values()) if self.lora is not None else []

    def _schedule_group(self, samples: list[Request]) -> None:
        self.scheduler.add_request(samples[0])
        if len(samples) > 1:
            self.scheduler.hold_siblings(samples[0], samples[1:])

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the constrained requests whose grammar compiled; fail those whose grammar did not."""
        failed = []
        for samples, error in self.structured.take_compiled():
            if error is None:
                self._schedule_group(samples)
                continue
            for request in samples:
                self.output_processor.fail(request, error)
            failed.append(samples[0].output_key)
        return self.output_processor.outputs(failed)

    def _fresh_seed(self) -> int:
        """Unseeded requests still get a stream of their own, derived from the engine seed: reproducible runs."""
        self._next_seed += 1
        return (self.seed * 1_000_003 + self._next_seed) & 0x7FFFFFFF

    def abort_request(self, request_id: str) -> RequestOutput | None:
        samples = self.output_processor.groups.get(request_id)
        if samples is None:
            return None
        for request in samples:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        self._flush_kv_events()
        output = self.output_processor.output(request_id)
        return self._embeddings([output])[0] if output is not None else None

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, (async scheduling) a launched step not yet applied, or blocks held for a KV
        transfer that has not ended (its end is polled by `step`): keep stepping."""
        return bool(self.output_processor.groups) or len(self.loop) > 0 or self.scheduler.has_pending_transfers

    def drain(self) -> list[RequestOutput]:
        """Apply every launched step, scheduling nothing new (async scheduling, pipeline stages; else a no-op)."""
        return self.loop.drain()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False, doing nothing, while requests are in flight."""
        if self.has_unfinished_requests():
            return False
        self.kv.reset_prefix_cache()
        self._flush_kv_events()
        return True

    def _flush_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.flush()

    def close_kv_events(self) -> None:
        """Stop the KV events publisher (its sockets and thread)."""
        if self.kv_events is not None:
            self.kv_events.close()

    # ---- one step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, launch and apply through the one step loop (engine/step_loop.py): with async scheduling or
        pipeline stages, a call may return the outputs of a step launched before the one it launched."""
        outputs = self._admit_compiled()
        self._finish_transfers()  # loads that ended resume (or fail) their requests before scheduling
        out, applied = self.loop.step()
        self._flush_kv_events()  # one batch per step: what it cached and evicted
        outputs += self._embeddings(self.output_processor.outputs_of(self.scheduler.take_failed())) + applied
        if out.is_empty and not outputs and not len(self.loop):
            self.structured.wait(timeout=0.05)  # idle but for compiling grammars (or KV loads): wait, never spin
        return outputs

    def _launch(self, out: SchedulerOutput, previous: InFlightStep | None) -> tuple[object | None, list]:
        """Launch `out` on the device (its KV connector instructions first); if that fails, fail its requests."""
        try:
            if self.lora is not None:  # each request's adapter in a device slot
                self.lora.assign(out, self.scheduler.running_adapters())
            return self.worker.launch(out, self.structured, previous.result if previous is not None else None), []
        except Exception as e:  # the device step failed: fail the requests it carried, keep serving
            return None, self._failed_step(out, e)

    def _failed_step(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        logger.exception("engine step %d failed", out.step)
        self.scheduler.release(out)
        failed = [s.request for s in out.scheduled if not s.request.is_finished]  # (async: not aborted since)
        for request in failed:
            self.output_processor.fail(request, f"engine step failed: {error}", uncache=True)
        return self._embeddings(self.output_processor.outputs_of(failed))

    def _apply(self, step: InFlightStep) -> list[RequestOutput]:
        """Bring a launched step's results to the host and apply them: tokens, stop rules, outputs, drafts, then
        the KV connector's saves of what it completed.

        Async scheduling: a request this step finishes (EOS, stop token or string, abort) may have a row in the
        step launched after it, computed in vain: `update` skips finished requests, so that row gives no output.
        Its blocks are freed now and may go to another request in the next schedule; the vain row's K/V write
        into them still lands first (every step takes the cache the one before it returned), so it is harmless.
        """
        out = step.out
        try:
            result = self.worker.collect(step.result, out.num_rows)
            if self.scheduler.draft_budget is not None:
                self.scheduler.draft_budget.observe_step(out.num_tokens, time.perf_counter() - step.launched)
        except Exception as e:
            return self._failed_step(out, e)
        now = time.monotonic()
        progressed = set()
        for scheduled in out.scheduled:
            if scheduled.scores_prompt and not scheduled.request.is_finished:
                self.output_processor.record_prompt_logprobs(scheduled, result)
        if self.pooler is not None and result.pooled is not None:  # each row's pooled hidden states, chunk by chunk
            for s in out.scheduled:
                if not s.request.is_finished:
                    pooled = result.pooled[s.logits_row]
                    self.pooler.add(
                        s.request.request_id, s.start, s.num_new_tokens, s.request.num_prompt_tokens, pooled
                    )
        for request, row, count in self.scheduler.update(out, result.token_ids):
            progressed.add(request.output_key)
            try:
                self.output_processor.process(request, result, row, count, now)
            except Exception as e:
                logger.exception("request %s failed in post-processing", request.request_id)
                self.output_processor.fail(request, f"{type(e).__name__}: {e}")
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running, self.structured, self.scheduler)
        if self.kv_connector is not None:  # what the step completed or finished: saved or offered before reuse
            self.kv_connector.worker.save_kv(self.kv_connector.scheduler.build_connector_meta([]))
            self._finish_transfers()  # offered: held blocks go back now
        return self._embeddings(self.output_processor.outputs(progressed))

    def _finish_transfers(self) -> None:
        if self.kv_connector is not None:
            self.scheduler.finish_transfers(self.kv_connector.worker.get_finished())

    # ---- introspection ---------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "num_steps": self.scheduler.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_for_grammar": self.structured.num_pending,
            "kv_cache_usage": self.kv.usage,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_blocks": self.kv.num_usable_blocks,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_waiting_for_remote_kvs": len(self.scheduler.waiting_for_remote),
            **self._spec_stats(),
            **self._expert_stats(),
            **self._lora_stats(),
            **(self.kv_connector.stats.totals() if self.kv_connector is not None else {}),
        }

    def _expert_stats(self) -> dict:
        """A mixture of experts' routing since start: sparse layer → tokens routed to each of its experts."""
        load = getattr(self.runner, "expert_load", None)  # (pipeline stages do not count yet)
        if load is None:
            return {}
        layers = self.runner.loaded.arch.sparse_layers()
        return {"moe_expert_tokens": {layer: row.tolist() for layer, row in zip(layers, load, strict=True)}}

    def _lora_stats(self) -> dict:
        """LoRA: the adapters of the running and waiting requests (names) and max_loras (vLLM's lora_requests_info)."""
        if self.lora is None:
            return {}

        def names(requests) -> list[str]:
            return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})

        running, waiting = names(self.scheduler.running), names(self.scheduler.waiting)
        return {"lora": {"running": running, "waiting": waiting, "max_loras": self.lora.config.max_loras}}

    def _spec_stats(self) -> dict:
        """Speculation's running totals (vLLM's counter names), or nothing without speculation."""
        stats = self.scheduler.spec_stats
        if stats is None:
            return {}
        return {
            "spec_decode_num_drafts": stats.num_drafts,
            "spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(stats.accepted_per_pos),
            "spec_decode_num_unspeculated": stats.num_unspeculated,
        }

"""SchedulerOutput → padded device batch → one compiled step (forward + KV write, then sampling).

Every bucket's forward, and the sampler of each row count (buckets with as many
sequence rows share one), is compiled ahead of time at start-up (`warm_up`), or loaded from the
executable cache (`executable_cache.py`) without tracing; `execute` only ever calls
those executables, so no step compiles — a shape the buckets do not cover is a bug and
fails loudly instead of recompiling. The KV cache is donated to each step and updated in
place. One device→host transfer per step brings back the sampled tokens (and logprobs).

With async scheduling (`SchedulerConfig.async_scheduling`) a step is launched (`launch`) before the
previous one's results reach the host (`collect`): its forward takes two more inputs, the previous
step's sampled ids (widened to the largest row count by a small executable per row count, compiled at
warm-up too) and `src` (int32 [T], the row of those ids each placeholder token is, -1 elsewhere), and
gathers `token_ids = where(src >= 0, prev_sampled[src], token_ids)` on the device. Its host arrays come
from two `InputBatch`es used in turn: a launched step may still be reading the other one (on CPU, JAX
may alias a numpy argument instead of copying it).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh

from jaxllm.config import EngineConfig
from jaxllm.kv_cache_groups import KVCacheGroups
from jaxllm.model import KVCache, StepInputs
from jaxllm.model.llama import expert_loads
from jaxllm.model.lora import tile_tokens
from jaxllm.parallel.mesh import replicated
from jaxllm.runner.buckets import Bucket, make_buckets, pick_bucket
from jaxllm.runner.compilations import watch_compilations
from jaxllm.runner.cpu_kernels import cpu_kernel_choice, step_model
from jaxllm.runner.executable_cache import ExecutableCache, abstract_signature, environment_fingerprint, fingerprint
from jaxllm.runner.input_batch import InputBatch
from jaxllm.runner.kv_cache import allocate_kv_cache, kv_cache_groups, num_kv_blocks
from jaxllm.runner.lora_slots import LoRASlots
from jaxllm.runner.sampler import SamplerOutput, SamplingInputs, sample
from jaxllm.scheduler_output import SchedulerOutput, max_logits_rows, request_rows
from jaxllm.weights import LoadedModel
from jaxllm.weights.params import unstack_layers
from pallas_kernels import cpu_ffi, stacked_matmul

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    """Host copies of one step's sampler results, rows in scheduled order (padding dropped)."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    top_token_ids: np.ndarray
    top_logprobs: np.ndarray
    target_logprobs: np.ndarray
    target_ranks: np.ndarray
    pooled: np.ndarray | None = None  # the pooling runner: a pooled hidden state [rows, H] per row, no tokens

    @classmethod
    def of_pooled(cls, pooled: np.ndarray) -> RunnerOutput:
        """A pooling step's results: its pooled rows, and no sampled token (zeros keep the scheduler's shapes)."""
        n = pooled.shape[0]
        empty = np.zeros((n, 0), np.float32)
        zeros = np.zeros(n, np.int32)
        return cls(zeros, zeros.astype(np.float32), zeros, empty, empty, empty, empty, pooled)


@dataclass
class StepStats:
    """Running totals of the runner's steps: how many, seconds packing inputs, seconds waiting on the device."""

    steps: int = 0
    device_s: float = 0.0
    pack_s: float = 0.0

    def snapshot(self) -> tuple[int, float, float]:
        return self.steps, self.device_s, self.pack_s


def _job_name(job: tuple) -> str:
    """A warm-up job for its progress bar: "forward 64 tokens x 4 rows", "sample 4 rows"."""
    kind, shape = job
    if isinstance(shape, Bucket):
        return f"{kind} {shape.num_tokens} tokens x {shape.num_seqs} rows"
    return f"{kind} {shape} rows"


class ModelRunner:
    """`executable_dir`: where compiled steps are stored and found (None: compile every bucket each start)."""

    counts_experts = True  # a mixture of experts' steps return their routing counts (`expert_load`)

    def __init__(self, loaded: LoadedModel, config: EngineConfig, mesh: Mesh, executable_dir: str | None = None):
        watch_compilations()  # the count behind "no compile while serving"
        self.loaded = loaded
        self.config = config
        self.mesh = mesh
        arch, cache_cfg, sched_cfg = loaded.arch, config.cache, config.scheduler
        self.block_size = cache_cfg.block_size
        self.max_blocks_per_seq = -(-sched_cfg.max_model_len // self.block_size)
        self.kv_groups = self._kv_groups()
        # the most blocks one request holds, over its groups: the pool must hold them, a KV connector moves as many
        self.max_blocks_per_request = self.kv_groups.blocks_needed(
            sched_cfg.max_model_len, self.block_size, sched_cfg.max_num_batched_tokens
        )
        started = time.perf_counter()
        # LoRA: adapters' device slots, first (the KV cache takes a share of the memory left)
        self.lora = None
        if config.lora is not None:
            dtype = config.lora.slot_dtype(jnp.dtype(loaded.dtype).name, bool(loaded.quant))
            self.lora = LoRASlots(arch, config.lora, mesh, dtype)
        self.num_blocks, self.cache = self._allocate_cache(cache_cfg.kv_dtype(loaded.dtype))
        self.startup_seconds = {"kv_cache": time.perf_counter() - started}  # phases, for the start-up report
        speculative = config.speculative
        self.buckets = make_buckets(
            sched_cfg.max_num_batched_tokens,
            request_rows(sched_cfg, speculative),
            max_logits_rows(sched_cfg, speculative),  # wider buckets for steps verifying drafts (speculation)
        )
        largest = self.buckets[-1]
        self.async_scheduling = sched_cfg.async_scheduling
        self._batches = [
            InputBatch(
                largest.num_tokens,
                largest.num_seqs,
                self.max_blocks_per_seq,
                sched_cfg.max_model_len,
                arch.vocab_size,
                self.block_size,
                self.kv_groups.num_groups,
            )
            # a launched step may still read its arrays: one per step in flight (async: +1, the one being filled)
            for _ in range(sched_cfg.max_steps_in_flight)
        ]
        self.batch = self._filled = self._batches[0]
        self._turn = 0  # the batch the next step fills
        self.max_rows = largest.num_seqs
        self.model = step_model(arch, config, loaded.dtype, mesh, loaded.quant, self.kv_groups)
        # the pooling runner: the forward returns each row's pooled hidden states, and no sampler runs
        self.pooling = config.pooler.pooling_type if config.runner == "pooling" and config.pooler else None
        if self.pooling is not None:
            self.model = self.model.clone(pooling=self.pooling)
        # for reports (cached: no second check)
        self.cpu_kernels = cpu_kernel_choice(arch, config, loaded.dtype, mesh, loaded.quant)
        self.set_params(loaded.params, laid_out=loaded.laid_out)
        loaded.params = None  # the runner owns the weights now (the stacked copy can go)
        self._executables = ExecutableCache(executable_dir)
        started = time.perf_counter()
        self._key = self._step_key(self.model.attention_backend)
        self.startup_seconds["step_key"] = time.perf_counter() - started
        # a step is two executables: the bucket's forward (logits, KV write; the cache donated) and the sampler of
        # its row count, which buckets with as many rows share (the sampler is ~80 % of a step's compile time)
        forward, name = (self._forward_async, "forward_async") if self.async_scheduling else (self._forward, "forward")
        self._forward_fn = jax.jit(self._named(forward, name), donate_argnums=(1,))
        self._sample_fn = jax.jit(self._named(sample, "sample"))
        self._widen_fn = jax.jit(self._named(self._widen, "widen"), out_shardings=replicated(mesh))
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}
        # LoRA: each bucket's forward with the adapters' terms (a step with an adapter in it)
        self._compiled_lora: dict[Bucket, jax.stages.Compiled] = {}
        self._samplers: dict[int, jax.stages.Compiled] = {}  # rows → sampler
        self._wideners: dict[int, jax.stages.Compiled] = {}  # rows → sampled ids widened to max_rows (async)
        self._no_prev = (
            jax.device_put(np.zeros(self.max_rows, np.int32), replicated(mesh)) if self.async_scheduling else None
        )
        self.compile_seconds = 0.0
        self.num_executables = self.loaded_executables = 0  # how many there are, and came from the cache
        self._load_seconds = 0.0  # spent loading from the executable cache (`load_cached_executables`)
        # a mixture of experts: tokens routed to each expert of each sparse layer since start (routing metrics)
        self.expert_load = (
            np.zeros((len(arch.sparse_layers()), arch.moe.num_experts), np.int64)
            if arch.moe is not None and self.counts_experts
            else None
        )
        self._step_loads: deque = deque(maxlen=8)  # launched steps' loads, on the device until collected
        self.stats = StepStats()

    def _kv_groups(self) -> KVCacheGroups:
        return kv_cache_groups(self.loaded.arch, self.config)

    def _allocate_cache(self, kv_dtype) -> tuple[int, KVCache]:
        """(blocks, the cache): as many blocks as the memory budget holds, each a slot per layer of a group."""
        arch, mesh, slots = self.loaded.arch, self.mesh, self.kv_groups.slots
        num_blocks = num_kv_blocks(arch, self.config.cache, kv_dtype, mesh, slots)
        return num_blocks, allocate_kv_cache(arch, num_blocks, self.block_size, kv_dtype, mesh, slots)

    def set_params(self, params, *, laid_out: bool = False) -> None:
        """The weights, stacked `[L, ...]` as loaders make them (`laid_out`: in `weight_layout` already),
        made what the step reads: packed for "cpu_packed", one array per layer when unrolled. `warm_up`
        needs only their shapes and shardings, so an engine may build the runner on ShapeDtypeStructs and
        set the weights once read (scanned layers)."""
        started = time.perf_counter()
        if self.model.matmul_backend == "cpu_packed" and not laid_out:
            params = self.model.pack(params)
        if not self.config.model.scan_layers:
            params = unstack_layers(params, self.loaded.arch.num_layers)
        self.startup_seconds["prepare_weights"] = time.perf_counter() - started
        self.params = params
        self._lora_params = None  # the weights merged with the LoRA slots (`run`), until they or a slot change

    def _forward(self, params, cache: KVCache, inputs: StepInputs):
        """(logits, the cache) and, for a mixture of experts, its sparse layers' tokens per expert in this step."""
        logits, cache, *loads = apply_counting_experts(
            self.model, params, cache, inputs, counting=self.expert_load is not None, mesh=self.mesh
        )
        return jax.lax.with_sharding_constraint(logits, replicated(self.mesh)), cache, *loads  # as the sampler takes

    def _forward_async(self, params, cache: KVCache, inputs: StepInputs, prev_sampled: Array, src: Array):
        """The forward, its placeholder tokens first taken from the previous step's sampled ids (async)."""
        token_ids = jnp.where(src >= 0, prev_sampled[jnp.maximum(src, 0)], inputs.token_ids)
        return self._forward(params, cache, inputs._replace(token_ids=token_ids))

    def _widen(self, token_ids: Array) -> Array:
        """A step's sampled ids [rows], zero-padded to [max_rows]: what the next step's forward takes (async)."""
        return jnp.zeros(self.max_rows, jnp.int32).at[: token_ids.shape[0]].set(token_ids.astype(jnp.int32))

    def _step_key(self, attention: str) -> str:
        """Everything but the shapes that decides the step's graph (see executable_cache.py)."""
        kernels: tuple = (False, False)
        if jax.default_backend() == "cpu":  # build and register the C++ kernels now: a loaded executable calls them
            from pallas_kernels.ragged_paged_attention import cpu

            cpu_ffi.prebuild(cpu.SOURCE, stacked_matmul.SOURCE)  # a cold start's two compiler runs side by side
            kernels = (cpu.available(), stacked_matmul.available(), cpu_ffi.march())
        model, devices = self.model, [d.id for d in self.mesh.devices.flat]
        return fingerprint(
            environment_fingerprint(),
            model.arch,
            str(model.dtype),
            attention,
            model.scan_layers,
            model.matmul_backend,
            model.matmul_kernel_max_rows,
            model.matmul_int8_min_rows,
            model.quant,
            model.kv_groups,
            kernels,
            self.mesh.shape,
            devices,
            model.pooling,
        )

    def _named(self, fn, name: str):
        """`fn` under a name carrying the step's key: JAX's persistent cache then never serves it under a key of
        ours it has not seen (executable_cache.py says why that matters)."""

        def named(*args):
            return fn(*args)

        named.__name__ = named.__qualname__ = f"jaxllm_{name}_{self._key[:16]}"
        return named

    def _abstract_inputs(self, bucket: Bucket, mesh: Mesh | None = None):
        """Shapes of one bucket's inputs, replicated over the mesh (or `mesh`)."""
        inputs, sampling = self.batch.fill(SchedulerOutput(step=-1), bucket)
        sharding = replicated(mesh or self.mesh)
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)  # noqa: E731
        return jax.tree.map(spec, inputs), jax.tree.map(spec, sampling)

    def _executable_jobs(self) -> dict[tuple, tuple]:
        """Every executable a step may call, not yet made: ("forward", bucket) and ("sample", rows) → (the
        jitted function, its abstract arguments)."""
        jobs: dict[tuple[str, Bucket | int], tuple[Callable, tuple]] = {}
        sharding = replicated(self.mesh)
        for bucket in self.buckets:
            inputs, sampling = self._abstract_inputs(bucket)
            rest: tuple = ()
            if self.async_scheduling:  # + the previous step's sampled ids and where they go
                prev = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=sharding)
                src = jax.ShapeDtypeStruct((bucket.num_tokens,), jnp.int32, sharding=sharding)
                rest = (prev, src)
            if bucket not in self._compiled:
                jobs["forward", bucket] = (self._forward_fn, (self.params, self.cache, inputs, *rest))
            if self.lora is not None and bucket not in self._compiled_lora:
                no_adapters = tile_tokens(np.zeros(bucket.num_tokens, np.int64), self.lora.config.num_slots)
                tiles = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), no_adapters)
                args = (self.lora.merged(self.params), self.cache, inputs._replace(lora=tiles), *rest)
                jobs["forward_lora", bucket] = (self._forward_fn, args)
            if self.async_scheduling and bucket.num_seqs < self.max_rows and bucket.num_seqs not in self._wideners:
                ids = jax.ShapeDtypeStruct((bucket.num_seqs,), jnp.int32, sharding=sharding)
                jobs["widen", bucket.num_seqs] = (self._widen_fn, (ids,))
            if bucket.num_seqs not in self._samplers and self.pooling is None:
                logits = jax.ShapeDtypeStruct(
                    (bucket.num_seqs, self.loaded.arch.vocab_size), jnp.float32, sharding=replicated(self.mesh)
                )
                jobs["sample", bucket.num_seqs] = (self._sample_fn, (logits, sampling))
        return jobs

    def load_cached_executables(self) -> int:
        """Load every executable the executable cache holds, one at a time in this thread. Returns how many.

        Call it while nothing else in the process compiles, runs or reads weights: a deserialization beside
        other XLA work crashed the process (a segfault in `deserialize_executable`, CI, jaxlib 0.10), so
        `Worker` loads before its weight-reading thread starts, and `warm_up` before it compiles anything.
        """
        started = time.perf_counter()
        jobs = self._executable_jobs()
        tables = self._executable_tables()
        for job, (_, args) in jobs.items():
            key = fingerprint(self._key, job[0], abstract_signature(args))
            if (loaded := self._executables.load(key, self.mesh.devices.flat)) is not None:
                tables[job[0]][job[1]] = loaded
                self.loaded_executables += 1
        self._load_seconds += time.perf_counter() - started
        return self.loaded_executables

    def warm_up(self, progress: bool = True) -> float:
        """Load or compile every executable now (each bucket's forward, each row count's sampler). Returns seconds.

        The executable cache's are loaded first (`load_cached_executables`); the others are traced and lowered one
        at a time (that holds the GIL) and compiled side by side in threads (XLA's compiler does not), then stored
        in the executable cache one at a time in this thread, once every compile is done.
        """
        from tqdm.auto import tqdm

        loaded = self.load_cached_executables()
        start = time.perf_counter()
        jobs = self._executable_jobs()
        futures, keys = {}, {}
        with (
            ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool,
            tqdm(
                total=len(jobs) + loaded,
                initial=loaded,
                desc="Compiling steps",
                unit="executable",
                disable=not progress,
            ) as bar,
        ):
            for job in reversed(jobs):  # largest first: the last compile to finish is a short one
                fn, args = jobs[job]
                keys[job] = fingerprint(self._key, job[0], abstract_signature(args))
                bar.set_postfix_str(f"tracing {_job_name(job)}")  # up to ~1 s each, in this thread: the bar moves
                futures[job] = pool.submit(self._executables.compile, fn.lower(*args))
                futures[job].add_done_callback(lambda _: bar.update())
            bar.set_postfix_str("compiling" if futures else "")
            made = {job: future.result() for job, future in futures.items()}
        tables = self._executable_tables()
        for (kind, shape), (executable, fresh) in made.items():
            tables[kind][shape] = executable
            if fresh:
                self._executables.store(keys[kind, shape], executable)
        if self.lora is not None:  # (small: ~0.1 s; not worth the executable cache)
            self.lora.compile()
        self.compile_seconds = self.startup_seconds["buckets"] = time.perf_counter() - start + self._load_seconds
        self.num_executables = sum(len(table) for table in tables.values())
        return self.compile_seconds

    def _executable_tables(self) -> dict[str, dict]:
        """Where `warm_up` puts each kind of executable it made, by shape."""
        return {
            "forward": self._compiled,
            "forward_lora": self._compiled_lora,
            "sample": self._samplers,
            "widen": self._wideners,
        }

    def execute(self, out: SchedulerOutput, grammar=None) -> RunnerOutput:
        """`grammar` (a StructuredOutputManager) fills the token masks of constrained rows."""
        return self.collect(self.launch(out, grammar), out.num_rows)

    def launch(self, out: SchedulerOutput, grammar=None, prev: SamplerOutput | None = None) -> SamplerOutput:
        """Pack and launch the step; its results stay on the device until `collect`. `prev`: the previous step's
        results, whose sampled ids fill this step's placeholder tokens (async scheduling)."""
        start = time.perf_counter()
        bucket, inputs, sampling = self.prepare(out, grammar)
        packed = time.perf_counter()
        if not self.async_scheduling:
            result = self.run(bucket, inputs, sampling)
        else:
            src = self._filled.src[: bucket.num_tokens]
            prev_ids = self._no_prev
            if any(s.num_placeholders for s in out.scheduled):
                if prev is None:
                    raise RuntimeError(f"step {out.step} has placeholder tokens but no previous step's results")
                prev_ids = self._widened(prev.token_ids)
            result = self.run(bucket, inputs, sampling, prev_ids, src)
        self.stats.pack_s += packed - start
        self.stats.device_s += time.perf_counter() - packed  # dispatch; `collect` adds the wait
        return result

    def collect(self, result: SamplerOutput, num_rows: int) -> RunnerOutput:
        """Wait for a launched step and bring its results to the host."""
        start = time.perf_counter()
        output = self.to_host(result, num_rows)
        self.stats.steps += 1
        self.stats.device_s += time.perf_counter() - start
        return output

    def _widened(self, token_ids: Array) -> Array:
        rows = token_ids.shape[0]
        if rows == self.max_rows:
            return token_ids
        widen = self._wideners.get(rows)
        if widen is None:
            raise RuntimeError(f"no widener for {rows} rows was compiled at start-up (call warm_up first)")
        return widen(token_ids)

    def prepare(self, out: SchedulerOutput, grammar=None) -> tuple[Bucket, StepInputs, SamplingInputs]:
        """The step's host inputs, padded to its bucket (a multi-host leader broadcasts these). With async
        scheduling the two input batches take turns (the last step launched may still read the other)."""
        bucket = pick_bucket(self.buckets, out.num_tokens, out.num_rows)
        batch = self._filled = self._batches[self._turn]
        self._turn = (self._turn + 1) % len(self._batches)
        inputs, sampling = batch.fill(out, bucket, grammar)
        if self.lora is not None and any(s.lora_slot for s in out.scheduled):  # the forward with adapters
            slots = np.zeros(bucket.num_tokens, np.int64)
            per_request = np.array([(s.lora_slot, s.num_new_tokens) for s in out.scheduled])
            slots[: out.num_tokens] = np.repeat(per_request[:, 0], per_request[:, 1])
            inputs = inputs._replace(lora=tile_tokens(slots, self.lora.config.num_slots))
        return bucket, inputs, sampling

    def prepare_lora(self, projections: dict):
        """An adapter's weights laid out as a device slot takes them (`LoRASlots.prepare`; host arrays)."""
        assert self.lora is not None, "enable_lora is off"
        return self.lora.prepare(projections)

    def load_lora(self, slot: int, prepared) -> None:
        """Write a prepared adapter into device slot `slot` (`LoRASlots.load`): nothing compiles."""
        assert self.lora is not None, "enable_lora is off"
        self.lora.load(slot, prepared)
        self._lora_params = None

    def run(
        self,
        bucket: Bucket,
        inputs: StepInputs,
        sampling: SamplingInputs,
        prev_sampled: Array | None = None,
        src: np.ndarray | None = None,
    ) -> SamplerOutput:
        """Launch the bucket's compiled step (the only part a multi-host follower runs); results stay on device.
        With async scheduling the forward also takes the previous step's (widened) sampled ids and `src`."""
        params = self.params
        forward, sampler = self._compiled.get(bucket), self._samplers.get(bucket.num_seqs)
        if inputs.lora is not None:  # adapters in the step: the weights beside their slots
            assert self.lora is not None
            if self._lora_params is None:
                self._lora_params = self.lora.merged(self.params)
            params, forward = self._lora_params, self._compiled_lora.get(bucket)
        if forward is None or (sampler is None and self.pooling is None):
            raise RuntimeError(f"bucket {bucket} was not compiled at start-up (call warm_up first)")
        if self.async_scheduling:
            assert prev_sampled is not None and src is not None, "an async step takes prev_sampled and src"
            logits, self.cache, *loads = forward(params, self.cache, inputs, prev_sampled, src)
        else:
            logits, self.cache, *loads = forward(params, self.cache, inputs)
        if self.pooling is not None:  # pooled rows [R, H]: the step's result as it is (`to_host` knows)
            return cast(SamplerOutput, logits)
        assert sampler is not None
        if loads:  # a mixture of experts' routing (a pipeline's: one array per stage with sparse layers)
            self._step_loads.append(loads)  # added up when the step is collected
        return sampler(logits, sampling)

    def to_host(self, result: SamplerOutput, n: int) -> RunnerOutput:
        if self.pooling is not None:
            return RunnerOutput.of_pooled(np.asarray(result)[:n])
        # leaf by leaf: `jax.device_get` first starts an asynchronous copy of each leaf, ~15 us apiece on CPU
        output = RunnerOutput(*(np.asarray(leaf)[:n] for leaf in result))
        if self._step_loads:  # this step's experts' loads (steps reach the host in launch order): done, no wait
            self.expert_load += np.concatenate([np.asarray(load) for load in self._step_loads.popleft()])
        return output


def apply_counting_experts(model, params, cache: KVCache, inputs: StepInputs, *rest, counting: bool, mesh: Mesh):
    """`model.apply`'s (output, cache), followed when `counting` by its sparse layers' tokens per expert in this
    step (`[sparse layers, E]`, replicated over `mesh`)."""
    if not counting:
        return cast(tuple[Array, KVCache], model.apply({"params": params}, cache, inputs, *rest))
    (out, cache), state = model.apply({"params": params}, cache, inputs, *rest, mutable=["intermediates"])
    return out, cache, jax.lax.with_sharding_constraint(expert_loads(state["intermediates"]), replicated(mesh))

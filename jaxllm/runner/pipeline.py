"""Pipeline parallelism in one process: the model's layers split over stages, each its own devices, compiled
steps and KV cache (docs/scaling.md).

`PipelineRunner` is a `ModelRunner` whose weights, KV cache and forward are per stage (`parallel/pipeline.py`
says which layers and devices). Stage s of a bucket is its own executable: the first stage embeds the tokens
and runs its layers, each later stage takes the previous stage's hidden states — `jax.device_put` onto its own
devices, an asynchronous copy — and the last applies the norm and LM head; the sampler runs on the last
stage's devices. Each stage's cache holds only its layers and is donated to its executable. JAX dispatches
asynchronously, so once the host has queued a batch's stages it can queue the next batch's: while stage s+1
runs batch i, stage s runs batch i+1 (the engine keeps up to PP batches in flight, engine/step_loop.py).

Over several processes (`--nnodes`) a runner holds only its own stages (`local`: those on this process's
devices): their weights, caches and executables; runner/pipeline_hosts.py moves the hidden states between them.
"""

from __future__ import annotations

import functools
from typing import cast

import jax
from jax import Array
from jax.sharding import Mesh, NamedSharding

from jaxllm.config import EngineConfig
from jaxllm.model import KVCache, StepInputs
from jaxllm.model.llama import stack_name
from jaxllm.parallel.mesh import replicated
from jaxllm.parallel.pipeline import layer_ranges, local_stages
from jaxllm.runner.buckets import Bucket
from jaxllm.runner.cpu_kernels import step_model
from jaxllm.runner.kv_cache import allocate_kv_cache, kv_cache_groups, num_kv_blocks
from jaxllm.runner.model_runner import ModelRunner, apply_counting_experts
from jaxllm.weights import LoadedModel


class StagedForward:
    """One bucket's forward through every stage: called as a single-stage forward is (`(params, cache, inputs)
    -> (logits, cache, *expert loads)`), with a tuple of per-stage params and caches; a mixture of experts' loads
    come one array per stage that has sparse layers, in layer order."""

    def __init__(self, stages: list, hidden_shardings: list[NamedSharding]):
        self.stages, self.hidden_shardings = stages, hidden_shardings

    def __call__(self, params: tuple, caches: tuple, inputs: StepInputs):
        updated, loads = list(caches), []
        out = None
        for s, stage in enumerate(self.stages):
            args: tuple = (params[s], updated[s], inputs)
            if s > 0:  # the previous stage's hidden states, copied onto this stage's devices
                args += (jax.device_put(out, self.hidden_shardings[s]),)
            out, updated[s], *stage_loads = stage(*args)
            loads += stage_loads  # (a stage with sparse layers: their tokens per expert)
        return out, tuple(updated), *loads


class PipelineRunner(ModelRunner):
    def __init__(self, loaded: LoadedModel, config: EngineConfig, meshes: list[Mesh]):
        arch = loaded.arch
        self.meshes = meshes
        self.local = local_stages(meshes)  # the stages this process holds (all of them in one process)
        self.ranges = layer_ranges(arch.num_layers, len(meshes))
        self.stage_archs = [arch.stage(a, b) for a, b in self.ranges]
        groups = kv_cache_groups(arch, config)
        self.stage_groups = [groups.stage(a, b) for a, b in self.ranges]  # each stage's cache: its layers' slots
        last = len(meshes) - 1
        self.stage_models = [
            step_model(stage_arch, config, loaded.dtype, mesh, loaded.quant, stage_groups).clone(
                first_stage=s == 0, last_stage=s == last
            )
            for s, (stage_arch, stage_groups, mesh) in enumerate(
                zip(self.stage_archs, self.stage_groups, meshes, strict=True)
            )
        ]
        # the executable cache stores executables for fixed devices: the stages compile (JAX's own cache serves)
        super().__init__(loaded, config, meshes[self.local[-1]], executable_dir=None)
        self._stage_fns = [
            jax.jit(self._named(self._stage_forward(s), f"stage{s}_forward"), donate_argnums=(1,))
            for s in range(len(meshes))
        ]
        self._stages: dict[tuple[int, Bucket], jax.stages.Compiled] = {}

    @property
    def num_stages(self) -> int:
        return len(self.meshes)

    @property
    def holds_last_stage(self) -> bool:
        """Whether the LM head and the sampler run here."""
        return self.local[-1] == self.num_stages - 1

    def _allocate_cache(self, kv_dtype) -> tuple[int, KVCache]:
        """A cache per stage with its layers only (None for another process's stage), all with the block count the
        tightest stage's budget holds (block ids are the scheduler's, the same in every stage and process)."""
        cache_cfg = self.config.cache
        stages = list(zip(self.stage_archs, self.meshes, (g.slots for g in self.stage_groups), strict=True))
        num_blocks = min(num_kv_blocks(a, cache_cfg, kv_dtype, m, slots) for a, m, slots in stages)
        caches = tuple(
            allocate_kv_cache(a, num_blocks, self.block_size, kv_dtype, m, slots) if s in self.local else None
            for s, (a, m, slots) in enumerate(stages)
        )
        return num_blocks, cast(KVCache, caches)

    def set_params(self, params, *, laid_out: bool = False) -> None:
        """The whole model's weights (stacked, as loaded; real or abstract) split into each stage's, on its devices
        (None for another process's stage)."""
        super().set_params(params, laid_out=laid_out)
        whole, last = self.params, self.num_stages - 1
        tied = self.loaded.arch.tie_word_embeddings
        stages: list[dict | None] = []
        for s, mesh in enumerate(self.meshes):
            if s not in self.local:
                stages.append(None)
                continue
            tree = self._stage_layers(whole, s, mesh)
            names = (["embed_tokens"] if s == 0 or (s == last and tied) else []) + (
                ["norm"] + ([] if tied else ["lm_head"]) if s == last else []
            )
            for name in names:
                tree[name] = jax.tree.map(lambda x, m=mesh: _onto(x, m), whole[name])
            stages.append(tree)
        self.params = tuple(stages)

    def _stage_layers(self, whole: dict, s: int, mesh: Mesh) -> dict:
        """Stage `s`'s stacks of layers, each run of its layers of one kind (`layer_runs`, renumbered from the
        stage's first layer) sliced from the whole model's stack that holds it, on `mesh`."""
        start = self.ranges[s][0]
        arch, stage_arch = self.loaded.arch, self.stage_archs[s]
        tree = {}
        for local_start, local_end, _ in stage_arch.layer_runs():
            first, last = start + local_start, start + local_end
            run_start, run_end, _ = next(r for r in arch.layer_runs() if r[0] <= first < r[1])
            assert last <= run_end, "a stage's run lies inside one of the model's"
            layers = functools.partial(_slice_onto, start=first - run_start, end=last - run_start, mesh=mesh)
            name = stack_name(local_start, stage_arch.num_layers, local_end)
            tree[name] = jax.tree.map(layers, whole[stack_name(run_start, arch.num_layers, run_end)])
        return tree

    def _stage_forward(self, s: int):
        model = self.stage_models[s]
        counting = self.expert_load is not None and bool(self.stage_archs[s].sparse_layers())

        def forward(params, cache: KVCache, inputs: StepInputs, hidden: Array | None = None):
            out, cache, *loads = apply_counting_experts(
                model, params, cache, inputs, hidden, counting=counting, mesh=self.meshes[s]
            )
            if s == self.num_stages - 1:
                out = jax.lax.with_sharding_constraint(out, replicated(self.meshes[s]))  # as the sampler takes them
            return out, cache, *loads

        return forward

    def _executable_jobs(self) -> dict[tuple, tuple]:
        """The base's samplers (where the last stage is), and per bucket each local stage's forward instead of one
        forward."""
        dropped = ("forward",) if self.holds_last_stage else ("forward", "sample")
        jobs = {job: spec for job, spec in super()._executable_jobs().items() if job[0] not in dropped}
        hidden_size = self.loaded.arch.hidden_size
        dtype = self.stage_models[0].dtype
        for bucket in self.buckets:
            for s, mesh in enumerate(self.meshes):
                if (s, bucket) in self._stages or s not in self.local:
                    continue
                inputs, _ = self._abstract_inputs(bucket, mesh)
                cache = jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.cache[s]
                )
                args: tuple = (self.params[s], cache, inputs)
                if s > 0:
                    args += (jax.ShapeDtypeStruct((bucket.num_tokens, hidden_size), dtype, sharding=replicated(mesh)),)
                jobs["stage", (s, bucket)] = (self._stage_fns[s], args)
        return jobs

    def _executable_tables(self) -> dict[str, dict]:
        return {**super()._executable_tables(), "stage": self._stages}

    def warm_up(self, progress: bool = True) -> float:
        seconds = super().warm_up(progress)
        if len(self.local) < self.num_stages:  # the other stages are other processes' (runner/pipeline_hosts.py)
            return seconds
        shardings = [replicated(m) for m in self.meshes]
        for bucket in self.buckets:
            self._compiled[bucket] = cast(
                jax.stages.Compiled,
                StagedForward([self._stages[s, bucket] for s in range(self.num_stages)], shardings),
            )
        return seconds


def _abstract(a: Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


def _onto(x, mesh: Mesh):
    """`x` (an array or an abstract one) with the same partitioning on another stage's mesh."""
    sharding = NamedSharding(mesh, x.sharding.spec)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.device_put(x, sharding)


def _slice_onto(x, start: int, end: int, mesh: Mesh):
    """Layers `start:end` of a stacked `[L, ...]` leaf, on `mesh`."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return _onto(jax.ShapeDtypeStruct((end - start, *x.shape[1:]), x.dtype, sharding=x.sharding), mesh)
    return _onto(x[start:end], mesh)

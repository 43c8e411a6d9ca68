"""One model on the device, ready to step: its weights, KV cache and compiled steps (a ModelRunner).

The engine's device side. `EngineCore` holds one Worker for the target model and, with a draft model, one
for the draft (spec_decode/draft_model.py); everything on the host (scheduler, KV block bookkeeping,
detokenizer, structured outputs) lives in the engine and never touches device arrays.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import jax
from jax.sharding import Mesh

from jaxllm.config import EngineConfig
from jaxllm.distributed.step_sync import StepLeader
from jaxllm.parallel.pipeline import local_stages, stage_meshes
from jaxllm.runner.cpu_kernels import weight_layout
from jaxllm.runner.model_runner import ModelRunner, RunnerOutput
from jaxllm.runner.pipeline import PipelineRunner
from jaxllm.runner.pipeline_hosts import HostsPipelineRunner
from jaxllm.scheduler_output import SchedulerOutput
from jaxllm.weights import LoadedModel, ModelSource
from pallas_kernels import progress as kernel_progress

if TYPE_CHECKING:
    from jaxllm.kv_transfer.base import KVConnectorWorker
    from jaxllm.runner.sampler import SamplerOutput


class Worker:
    """Loads `source` onto `mesh` and compiles (or loads) every step while its weights are read.

    Compiling needs only the weights' shapes, so a thread reads the weights and the tokenizer meanwhile
    (unrolled layers, and multi-host starts, read them first). The loader packs the weights for the CPU
    kernel (and keeps them packed on disk). `progress`: bars on stderr for what takes seconds (the CPU kernels'
    self-check and the weights' conversion on first use, compiling the steps); the first two also log a line at INFO."""

    def __init__(
        self,
        source: ModelSource,
        config: EngineConfig,
        mesh: Mesh,
        *,
        tokenizer: str | None = None,
        seed: int = 0,
        executable_dir: str | None = None,
        progress: bool = True,
    ):
        arch = source.arch
        overlap = config.model.scan_layers and jax.process_count() == 1
        pp = config.parallel.pipeline_parallel_size
        if pp > 1:  # the weights load onto this process's first stage's devices, then spread
            meshes = stage_meshes(pp, config.parallel.tensor_parallel_size)
            mesh = meshes[local_stages(meshes)[0]]
        with kernel_progress.showing(progress), ThreadPoolExecutor(1, thread_name_prefix="jaxllm-load") as pool:
            layout = weight_layout(arch, config, source.dtype, mesh, source.quant)  # first use: kernels built, checked
            # the reading converts the weights on first use: its bar follows `progress` too, in a thread
            context = contextvars.copy_context()

            def read() -> LoadedModel:
                return context.run(source.load, mesh, tokenizer, seed, layout)

            model = (
                LoadedModel(source.name, arch, source.hf_config, source.abstract_params(mesh), None, source.dtype)
                if overlap
                else read()
            )
            model.quant = source.quant
            if pp == 1:
                self.runner = ModelRunner(model, config, mesh, executable_dir=executable_dir)
            elif jax.process_count() == 1:
                self.runner = PipelineRunner(model, config, meshes)
            else:  # stages on several nodes
                self.runner = HostsPipelineRunner(model, config, meshes, config.parallel.distributed_timeout)
            usable = max(self.runner.num_blocks - 1, 0)  # block 0 is scratch
            needed = self.runner.max_blocks_per_request
            if usable < needed:
                raise ValueError(
                    f"the KV cache of {source.name} holds {usable} blocks, fewer than the {needed} one sequence of "
                    f"max_model_len={config.scheduler.max_model_len} tokens needs: raise kv_cache_memory_bytes or "
                    f"gpu_memory_utilization, or lower max_model_len"
                )
            # cached executables load while nothing else in the process touches XLA (`load_cached_executables`)
            self.runner.load_cached_executables()
            reading = pool.submit(read) if overlap else None
            self.runner.warm_up(progress=progress)
            waited = time.perf_counter()
            self.loaded = reading.result() if reading is not None else model
            if overlap:  # laid out by the loader: nothing left to rearrange (unrolled layers never overlap)
                self.runner.set_params(self.loaded.params, laid_out=self.loaded.laid_out)
                self.loaded.params = None  # the runner owns the weights now
        self.waiting_for_weights = time.perf_counter() - waited  # seconds after the steps were ready
        self.kv_connector: KVConnectorWorker | None = None  # a KV connector's runner half (`attach_kv_connector`)
        self.step_leader: StepLeader | None = None  # multi-host node 0 (`lead_followers`)

    def attach_kv_connector(self, connector: KVConnectorWorker) -> None:
        """Each step's `kv_connector_metadata` goes to `connector` before the forward."""
        self.kv_connector = connector

    def lead_followers(self, timeout: float) -> None:
        """Multi-host node 0: broadcast every step to the follower nodes (which run `distributed.follow`)."""
        self.step_leader = StepLeader(self.runner, timeout)

    def launch(self, out: SchedulerOutput, grammar=None, previous=None) -> RunnerOutput | SamplerOutput | None:
        """Carry out the step's KV connector instructions (evicted blocks out, loads in), then launch its forward;
        None when it schedules nothing. `previous`: the results of the step launched before (async scheduling)."""
        if out.kv_connector_metadata is not None:
            assert self.kv_connector is not None, "a step carries KV connector instructions, but none is attached"
            self.kv_connector.start_load_kv(out.kv_connector_metadata)
        if out.is_empty:
            return None
        if self.step_leader is not None:  # (never async: refused at start-up)
            return self.step_leader.execute(out, grammar=grammar)
        return self.runner.launch(out, grammar, previous)

    def collect(self, result: RunnerOutput | SamplerOutput, num_rows: int) -> RunnerOutput:
        """A launched step's results on the host."""
        return result if isinstance(result, RunnerOutput) else self.runner.collect(result, num_rows)

    @property
    def startup_phases(self) -> dict[str, float]:
        """Where start-up went (benchmarks/startup.py): weights (packed for the CPU kernel), tokenizer (in a
        thread, beside the next three), kv_cache, step_key, buckets, waiting_for_weights (after the buckets),
        prepare_weights (what the runner still rearranges: unrolled layers)."""
        return {
            **self.loaded.load_seconds,
            **self.runner.startup_seconds,
            "waiting_for_weights": self.waiting_for_weights,
        }

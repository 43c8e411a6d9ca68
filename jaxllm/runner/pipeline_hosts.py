"""Pipeline stages on several processes (`--nnodes`): each process runs its own stages of every step, and the
hidden states and sampled tokens cross between processes with `jax.experimental.transfer` (distributed/stage_link.py).

Every process runs the same steps in the same order (node 0 broadcasts each one, distributed/step_sync.py), so a
step's number is a count each keeps for itself and names its transfers. Per step: node 0 embeds and runs its
stages, and offers the hidden states; the node with the next stage pulls them (waiting with a deadline), runs its
stages and offers its own; the last stage's node samples and offers the sampled ids (and logprob arrays) back to
node 0, which pulls them right after launching its stages and waits for them only when the engine applies the
step (`collect`), so its next step's stages can start meanwhile.
"""

from __future__ import annotations

from typing import cast

import jax
import numpy as np
from jax.sharding import Mesh

from jaxllm.config import EngineConfig
from jaxllm.distributed.stage_link import StageLink
from jaxllm.model import KVCache
from jaxllm.parallel.mesh import replicated
from jaxllm.runner.buckets import Bucket
from jaxllm.runner.model_runner import RunnerOutput
from jaxllm.runner.pipeline import PipelineRunner
from jaxllm.runner.sampler import SamplerOutput, sample
from jaxllm.weights import LoadedModel


class HostsPipelineRunner(PipelineRunner):
    counts_experts = False  # the routing metrics would need every node's stages: not counted over nodes

    def __init__(self, loaded: LoadedModel, config: EngineConfig, meshes: list[Mesh], timeout: float):
        super().__init__(loaded, config, meshes)
        self.owner = [next(iter(m.devices.flat)).process_index for m in meshes]  # each stage's node
        self.rank = jax.process_index()
        self.link = StageLink(timeout)
        self._step = 0  # steps run: the same count on every node
        self._results: dict[int, tuple] = {}  # rows → (treedef, specs) of a sampler's output here (node 0)

    def _hidden_spec(self, bucket: Bucket, s: int) -> jax.ShapeDtypeStruct:
        """What stage `s` takes from the stage before it."""
        shape = (bucket.num_tokens, self.loaded.arch.hidden_size)
        return jax.ShapeDtypeStruct(shape, self.stage_models[0].dtype, sharding=replicated(self.meshes[s]))

    def run(self, bucket: Bucket, inputs, sampling, prev_sampled=None, src=None):
        """This node's part of the step: pull, run its stages, offer. Node 0 gets back the sampled ids being pulled
        (ready once the last stage has run); the last stage's node its sampler's output; others the hidden states."""
        step, self._step = self._step, self._step + 1
        first = self.local[0]
        hidden = None
        if first > 0:
            (hidden,) = self.link.pull(self.owner[first - 1], step, [self._hidden_spec(bucket, first)])
            self.link.wait([hidden], f"step {step}'s hidden states from node {self.owner[first - 1]}")
        caches = list(self.cache)
        for s in self.local:
            stage = self._stages.get((s, bucket))
            if stage is None:
                raise RuntimeError(f"bucket {bucket} was not compiled at start-up (call warm_up first)")
            args: tuple = (self.params[s], caches[s], inputs)
            if s > 0:  # from the stage before (another node's, pulled above, or this node's)
                args += (jax.device_put(hidden, replicated(self.meshes[s])),)
            hidden, caches[s] = stage(*args)
        self.cache = cast(KVCache, tuple(caches))  # a cache per stage (None: another node's), as PipelineRunner's
        if not self.holds_last_stage:
            self.link.offer(step, [hidden])
            return self._pull_results(step, bucket) if first == 0 else hidden
        result = self._samplers[bucket.num_seqs](hidden, sampling)
        self.link.offer(step, jax.tree.leaves(result))  # for node 0
        return result

    def warm_up(self, progress: bool = True) -> float:
        seconds = super().warm_up(progress)
        if not self.holds_last_stage:  # node 0: the shapes of the sampler outputs it pulls, by row count
            here = replicated(self.meshes[0])
            for bucket in self.buckets:  # (`_abstract_inputs` refills the input batch: never during a step)
                _, sampling = self._abstract_inputs(bucket)
                logits = jax.ShapeDtypeStruct((bucket.num_seqs, self.loaded.arch.vocab_size), np.float32)
                leaves, treedef = jax.tree.flatten(jax.eval_shape(sample, logits, sampling))
                specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here) for a in leaves]
                self._results[bucket.num_seqs] = (treedef, specs)
        return seconds

    def _pull_results(self, step: int, bucket: Bucket) -> SamplerOutput:
        """Node 0: start pulling the step's sampler output from the last stage's node."""
        treedef, specs = self._results[bucket.num_seqs]
        return jax.tree.unflatten(treedef, self.link.pull(self.owner[-1], step, specs))

    def collect(self, result: SamplerOutput, num_rows: int) -> RunnerOutput:
        """Node 0: wait (with the deadline) for the last stage's sampled ids, then bring them to the host."""
        self.link.wait(jax.tree.leaves(result), f"a step's sampled tokens from node {self.owner[-1]}")
        return super().collect(result, num_rows)

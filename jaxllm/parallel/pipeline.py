"""Pipeline parallelism's layout: which layers each stage holds, and each stage's devices.

Stage s runs layers `ranges[s]` on its own mesh of `tensor_parallel_size` devices (devices s*TP .. s*TP+TP-1);
the first stage also embeds the tokens, the last applies the final norm and the LM head. Layers split as vLLM's
`get_pp_indices` splits them: evenly, the remainder one each to the stages before the last (which carries the
head), or as `JAXLLM_PP_LAYER_PARTITION="15,15"` says (vLLM's `VLLM_PP_LAYER_PARTITION`).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from jaxllm.parallel.mesh import MESH_AXES

PARTITION_ENV = "JAXLLM_PP_LAYER_PARTITION"


def layer_ranges(num_layers: int, pipeline_parallel_size: int, partition: str | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers."""
    pp = pipeline_parallel_size
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more stages than the model's {num_layers} layers")
    partition = partition if partition is not None else os.environ.get(PARTITION_ENV)
    if partition:
        try:
            counts = [int(n) for n in partition.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={partition!r} is not a comma-separated list of layer counts") from None
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{PARTITION_ENV}={partition!r} must give each of the {pp} stages at least one layer, "
                f"{num_layers} in all"
            )
    else:
        counts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            counts[-i] += 1
    starts = np.cumsum([0] + counts)
    return [(int(starts[i]), int(starts[i + 1])) for i in range(pp)]


def stage_meshes(pipeline_parallel_size: int, tensor_parallel_size: int) -> list[Mesh]:
    """A ("data", "model") mesh of `tensor_parallel_size` devices per stage, in device order."""
    devices = jax.devices()
    needed = pipeline_parallel_size * tensor_parallel_size
    if needed > len(devices):
        hint = (
            f" (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={needed} splits it into {needed})"
            if jax.default_backend() == "cpu"
            else ""
        )
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size} x tensor_parallel_size={tensor_parallel_size} needs "
            f"{needed} devices, but only {len(devices)} {jax.default_backend()} device(s) are visible{hint}"
        )
    tp = tensor_parallel_size
    meshes = [
        Mesh(np.array(devices[s * tp : (s + 1) * tp]).reshape(1, tp), MESH_AXES) for s in range(pipeline_parallel_size)
    ]
    if jax.process_count() > 1:
        _check_whole_stages(meshes, needed, len(devices))
    return meshes


def _check_whole_stages(meshes: list[Mesh], needed: int, visible: int) -> None:
    """Over several processes each holds whole stages, and every process holds one: a stage's layers run on one
    host (its tensor parallelism never crosses the network) and every host has work."""
    layout = f"pipeline_parallel_size={len(meshes)} x tensor_parallel_size={meshes[0].size}"
    nodes = jax.process_count()
    for s, mesh in enumerate(meshes):
        owners = sorted({d.process_index for d in mesh.devices.flat})
        if len(owners) > 1:
            raise ValueError(
                f"{layout} over {nodes} nodes: stage {s} spans nodes {owners}; each node must hold whole stages "
                f"(tensor_parallel_size dividing each node's {jax.local_device_count()} devices)"
            )
    if needed != visible:
        raise ValueError(
            f"{layout} over {nodes} nodes uses {needed} of their {visible} devices: with pipeline stages on several "
            "nodes every device holds a stage (pipeline_parallel_size x tensor_parallel_size = all nodes' devices)"
        )


def local_stages(meshes: list[Mesh]) -> list[int]:
    """The stages whose devices are this process's (all of them in a single process)."""
    here = jax.process_index()
    return [s for s, mesh in enumerate(meshes) if all(d.process_index == here for d in mesh.devices.flat)]

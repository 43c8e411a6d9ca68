"""LoRA adapters' device slots: for each projection of each stack of layers, "lora_a" `[L, S, R, K]` and, per part of
the fused projection (q, k, v; gate, up; or the one), "lora_b<p>" `[L, S, r, *part]` (model/lora.py), slot 0 zeros,
slots 1..max_loras an adapter each.

B is kept per part rather than as one block-diagonal `[R, *N]` (what `lora/peft.py` reads): q's rows never meet k's
or v's columns, so the block form would read and multiply 2-4x the weights a step needs (at batch 1 the adapters'
bytes are what LoRA costs). The shapes never change, so an adapter is loaded (or replaced) by one executable compiled
at warm-up that writes its slot in place (the slot arrays donated): no compile while serving. A is stored as PEFT
stores it, `[r, in]` per part (the parts' ranks stacked): each rank's row is contiguous, as the CPU kernel's shrink
reads it (pallas_kernels/stacked_matmul/lora.py). A and B are stored as `dtype` (`LoRAConfig.slot_dtype`).
"""

from __future__ import annotations

from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import LoRAConfig
from jaxllm.lora.peft import PROJECTIONS, fused_shapes, regions
from jaxllm.model.llama import stack_name
from jaxllm.model.registry import ModelArch

# fused projection → (its module in a layer, the mesh axes of its input and of its output's axes, as `Linear` shards)
PLACES = {
    "qkv_proj": (("self_attn", "qkv_proj"), None, ("model", None, None)),
    "o_proj": (("self_attn", "o_proj"), "model", (None,)),
    "gate_up_proj": (("mlp", "gate_up_proj"), None, (None, "model")),
    "down_proj": (("mlp", "down_proj"), "model", (None,)),
}

Adapter = dict[str, dict[str, dict[str, dict[str, np.ndarray]]]]  # stack → module → projection → leaf → one slot


class LoRASlots:
    """The slot arrays of every projection (`tree`: parameters to merge into the model's, `merged`), `prepare` (an
    adapter laid out as its slot, on the host) and `load` (written into a slot)."""

    def __init__(self, arch: ModelArch, config: LoRAConfig, mesh: Mesh, dtype: str = "float32"):
        self.arch, self.config = arch, config
        s, r = config.num_slots, config.max_lora_rank
        self.stacks = [(stack_name(start, arch.num_layers, end), start, end) for start, end, _ in arch.layer_runs()]
        self.tree: dict = {}
        for name, (k, out) in fused_shapes(arch).items():
            (module, proj), in_axis, out_axes = PLACES[name]
            width = len(PROJECTIONS[name]) * r
            for stack, start, end in self.stacks:
                layers = end - start
                leaves: dict[str, tuple[tuple[int, ...], P]] = {
                    "lora_a": ((layers, s, width, k), P(None, None, None, in_axis))
                }
                for p, part in enumerate(_parts(arch, name, out)):
                    leaves[f"lora_b{p}"] = ((layers, s, r, *part), P(None, None, None, *out_axes))
                self.tree.setdefault(stack, {}).setdefault(module, {})[proj] = {
                    leaf: jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, spec))
                    for leaf, (shape, spec) in leaves.items()
                }
        self._write = jax.jit(_write_slot, donate_argnums=(0,))
        self._compiled: jax.stages.Compiled | None = None

    def abstract(self):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.tree)

    def merged(self, params):
        """`params` with every projection's slot arrays beside its weights (what a LoRA step's forward takes)."""
        out = dict(params)
        for stack, modules in self.tree.items():
            out[stack] = dict(out[stack])
            for module, projections in modules.items():
                out[stack][module] = dict(out[stack][module])
                for proj, leaves in projections.items():
                    out[stack][module][proj] = {**out[stack][module][proj], **leaves}
        return out

    def compile(self):
        """The slot write's executable (warm-up)."""
        one_slot = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[:1] + a.shape[2:], a.dtype), self.tree)
        self._compiled = self._write.lower(self.abstract(), jnp.int32(0), one_slot).compile()
        return self._compiled

    def prepare(self, projections: dict[str, tuple[np.ndarray, np.ndarray]]) -> Adapter:
        """An adapter (`lora.peft.LoRAWeights.projections`: A `[L, K, parts * max_rank]`, B `[L, parts * max_rank,
        *N]`) laid out as one slot: A transposed, B cut into its parts (host arrays: a slot write then only moves
        them)."""
        r, values = self.config.max_lora_rank, cast(Adapter, {})
        for name, ((module, proj), _, _) in PLACES.items():
            a, b = projections[name]
            part_regions = [regions(self.arch)[m] for m in PROJECTIONS[name]]
            for stack, start, end in self.stacks:
                leaves = self.tree[stack][module][proj]
                arrays = {"lora_a": a[start:end].transpose(0, 2, 1)}
                for p, region in enumerate(part_regions):
                    arrays[f"lora_b{p}"] = b[(slice(start, end), slice(p * r, (p + 1) * r), *region)]
                values.setdefault(stack, {}).setdefault(module, {})[proj] = {
                    leaf: np.ascontiguousarray(v, leaves[leaf].dtype) for leaf, v in arrays.items()
                }
        return values

    def load(self, slot: int, adapter: Adapter) -> None:
        """Write a prepared adapter into `slot` (1..max_loras)."""
        assert self._compiled is not None, "LoRASlots.compile runs at warm-up"
        assert 1 <= slot <= self.config.max_loras, f"slot {slot} out of 1..{self.config.max_loras}"
        self.tree = self._compiled(self.tree, np.int32(slot), adapter)


def _parts(arch: ModelArch, name: str, out: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The output shape of each part of a fused projection (its region of `out`)."""
    return [np.empty(out, np.bool_)[regions(arch)[m]].shape for m in PROJECTIONS[name]]


def _write_slot(tree, slot, values):
    return jax.tree.map(lambda a, v: a.at[:, slot].set(v), tree, values)

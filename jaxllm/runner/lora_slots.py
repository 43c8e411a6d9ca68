"""LoRA adapters' device slots: for each projection of each stack of layers, "lora_a" `[L, S, K, R]` and "lora_b"
`[L, S, R, *N]` (model/lora.py), slot 0 zeros, slots 1..max_loras an adapter each.

The shapes never change, so an adapter is loaded (or replaced) by one executable compiled at warm-up that writes
its slot in place (the slot arrays donated): no compile while serving. On "cpu_packed", each layer's slot is packed
for the CPU kernel on the host before it moves. A and B are float32 whatever the model's type (a few MB an adapter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import LoRAConfig
from jaxllm.lora.peft import PROJECTIONS, fused_shapes
from jaxllm.model.grouped import flat_stack
from jaxllm.model.llama import stack_name
from jaxllm.model.lora import rank_width
from jaxllm.model.registry import ModelArch
from pallas_kernels import stacked_matmul

# fused projection → (its module in a layer, the mesh axes of its input and of its output's axes, as `Linear` shards)
PLACES = {
    "qkv_proj": (("self_attn", "qkv_proj"), None, ("model", None, None)),
    "o_proj": (("self_attn", "o_proj"), "model", (None,)),
    "gate_up_proj": (("mlp", "gate_up_proj"), None, (None, "model")),
    "down_proj": (("mlp", "down_proj"), "model", (None,)),
}


class LoRASlots:
    """The slot arrays of every projection (`tree`: parameters to merge into the model's, `merged`), and `load`."""

    def __init__(self, arch: ModelArch, config: LoRAConfig, mesh: Mesh, packed: bool):
        self.arch, self.config, self.mesh, self.packed = arch, config, mesh, packed
        s = config.num_slots
        self.stacks = [(stack_name(start, arch.num_layers, end), start, end) for start, end, _ in arch.layer_runs()]
        self.tree: dict = {}
        self.shardings: dict = {}
        for name, (k, out) in fused_shapes(arch).items():
            (module, proj), in_axis, out_axes = PLACES[name]
            r = rank_width(len(PROJECTIONS[name]), config.max_lora_rank)
            for stack, start, end in self.stacks:
                shapes = {"lora_a": (end - start, s, k, r), "lora_b": (end - start, s, r, *out)}
                specs = {"lora_a": P(None, None, in_axis, None), "lora_b": P(None, None, None, *out_axes)}
                for leaf, shape in shapes.items():
                    sharding = NamedSharding(mesh, specs[leaf])
                    self.shardings.setdefault(stack, {}).setdefault(module, {}).setdefault(proj, {})[leaf] = sharding
                    zeros = jax.device_put(np.zeros(shape, np.float32), sharding)
                    self.tree.setdefault(stack, {}).setdefault(module, {}).setdefault(proj, {})[leaf] = zeros
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

    def _slot_abstract(self):
        """One slot's arrays (the write's argument): each leaf without its S axis, float32 on the host."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[:1] + a.shape[2:], a.dtype), self.tree)

    def compile(self):
        """The slot write's executable (warm-up)."""
        self._compiled = self._write.lower(self.abstract(), jnp.int32(0), self._slot_abstract()).compile()
        return self._compiled

    def load(self, slot: int, projections: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Write an adapter into `slot` (1..max_loras): `projections` as `lora.peft.LoRAWeights` has them (A `[L, K,
        parts * max_rank]`, B `[L, parts * max_rank, *N]`, float32)."""
        assert self._compiled is not None, "LoRASlots.compile runs at warm-up"
        assert 1 <= slot <= self.config.max_loras, f"slot {slot} out of 1..{self.config.max_loras}"
        values: dict = {}
        for name, ((module, proj), _, _) in PLACES.items():
            a, b = projections[name]
            for stack, start, end in self.stacks:
                leaves = self.tree[stack][module][proj]
                width = leaves["lora_a"].shape[-1]
                padded = {"lora_a": _pad(a[start:end], width, axis=2), "lora_b": _pad(b[start:end], width, axis=1)}
                values.setdefault(stack, {}).setdefault(module, {})[proj] = {
                    leaf: _pack(v) if self.packed and stacked_matmul.packable(flat_stack(leaves[leaf])) else v
                    for leaf, v in padded.items()
                }  # (packed as `Linear` reads them: on "cpu_packed", every leaf the kernel takes)
        self.tree = self._compiled(self.tree, np.int32(slot), values)


def _write_slot(tree, slot, values):
    return jax.tree.map(lambda a, v: a.at[:, slot].set(v), tree, values)


def _pad(a: np.ndarray, width: int, axis: int) -> np.ndarray:
    """`a` with its rank axis zero-padded to `width` columns (float32, contiguous)."""
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, width - a.shape[axis])
    return np.ascontiguousarray(np.pad(a.astype(np.float32), pad))


def _pack(a: np.ndarray) -> np.ndarray:
    """Each layer `[K, *N]` of one slot packed as the CPU kernel reads it."""
    return np.ascontiguousarray(stacked_matmul.pack(a))

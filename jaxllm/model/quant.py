"""Quantized weights inside the model: which projections are quantized (`QuantPlan`) and their parameters.

A quantized projection stores, in place of its float `kernel [K, *N]`, the three arrays of
`pallas_kernels.stacked_matmul.quantized.QuantizedWeight` under the names "qweight" (int8 `[K, *N]` or
4-bit pairs uint8 `[K / 2, *N]`), "scales" and, for formats with a minimum, "mins" (float16 `[K / G, *N]`),
sharded as the kernel is (weights/quant/plan.py decides the plan, weights/params.py fills the arrays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax.numpy as jnp

from pallas_kernels.stacked_matmul import PANEL
from pallas_kernels.stacked_matmul.quantized import FORMATS, QuantizedWeight

QUANT_LEAVES = ("qweight", "scales", "mins")


@dataclass(frozen=True)
class QuantPlan:
    """Module name ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head") → format,
    as sorted pairs (hashable: it keys the compiled steps and the converted weights); a name left out is float."""

    formats: tuple[tuple[str, str], ...] = ()

    def get(self, name: str | None) -> str | None:
        return dict(self.formats).get(name) if name else None

    def __bool__(self) -> bool:
        return bool(self.formats)

    def describe(self) -> str:
        return ", ".join(f"{name} {fmt}" for name, fmt in self.formats) or "none"


NO_QUANT = QuantPlan()  # every weight float


def quantized_params(declare, fmt: str, k: int, out_shape: tuple[int, ...], in_spec, out_spec: tuple):
    """Declare a quantized weight's arrays with `declare(name, init, spec, shape, dtype)` (a module's `param`,
    or a `Stacking`'s) and return them as a `QuantizedWeight`. A single group (per-channel int8) is not split."""
    spec = FORMATS[fmt]
    groups = 1 if spec.group is None else k // spec.group
    qdtype = jnp.int8 if spec.bits == 8 else jnp.uint8
    zeros = nn.initializers.zeros  # only ever shapes: the loaders fill them
    qs = declare("qweight", zeros, (in_spec, *out_spec), (k * spec.bits // 8, *out_shape), qdtype)
    group_spec = (in_spec if groups > 1 else None, *out_spec)
    scales = declare("scales", nn.initializers.ones, group_spec, (groups, *out_shape), jnp.float16)
    mins = declare("mins", zeros, group_spec, (groups, *out_shape), jnp.float16) if spec.has_min else None
    return QuantizedWeight(qs, scales, mins)


def packs_quantized(stacked_shape: tuple[int, ...]) -> bool:
    """Whether "cpu_packed" packs (and reads packed) a stacked quantized weight's arrays `[L, rows, *N]`: N in
    whole panels, the one rule `CausalLM.pack_leaf` and the matmul share."""
    return math.prod(stacked_shape[2:]) % PANEL == 0

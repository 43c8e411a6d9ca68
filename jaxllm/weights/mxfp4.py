"""gpt-oss's released checkpoints: experts in MXFP4 (OCP microscaling), dequantized as they are read.

Each expert projection is saved as `<name>_blocks` (`[E, out, in / 32, 16]` uint8: 32 FP4 E2M1 values a block, two
a byte, low nibble first) and `<name>_scales` (`[E, out, in / 32]` uint8: a power-of-two exponent per block, biased
by 127), with everything else in bfloat16. Every MXFP4 value is a bfloat16 exactly, so dequantizing loses nothing;
`quantization="int8"|"int4"` then keeps the experts small, as for any float checkpoint.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxllm.weights.params import GetTensor

logger = logging.getLogger(__name__)

# E2M1: the 16 values a 4-bit code stands for (sign, two exponent bits, one mantissa bit)
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
EXPERT_PROJECTIONS = ("experts.gate_up_proj", "experts.down_proj")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`[..., G, 16]` packed codes and `[..., G]` exponents → float32 `[..., G * 32]`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(*scales.shape, 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], -1)


def with_mxfp4_experts(get_tensor: GetTensor, source: str) -> GetTensor:
    """`get_tensor` that answers an expert projection saved in MXFP4 (`...experts.gate_up_proj` and `down_proj`) with
    its dequantized float32 tensor, `[E, in, out]` as the bfloat16 checkpoints hold it; other names as saved."""
    told = False

    def get(name: str) -> np.ndarray:
        nonlocal told
        if not name.endswith(EXPERT_PROJECTIONS):
            return get_tensor(name)
        if not told:
            logger.info("%s: gpt-oss's MXFP4 experts are dequantized as they load (exact in bfloat16)", source)
            told = True
        blocks, scales = (np.asarray(get_tensor(f"{name}_{part}")) for part in ("blocks", "scales"))
        experts = np.stack([dequantize(b, s) for b, s in zip(blocks, scales, strict=True)])  # one expert at a time
        return experts.transpose(0, 2, 1)  # [E, out, in] → [E, in, out]

    return get

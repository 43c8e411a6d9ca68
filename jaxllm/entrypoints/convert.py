"""`jaxllm convert SRC --out checkpoints/NAME`: any readable model → an Orbax checkpoint that loads fast."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jaxllm.parallel.mesh import make_mesh
from jaxllm.weights import load_model
from jaxllm.weights.orbax import save_checkpoint


def convert(source: str | None, out: str, dtype: str = "auto") -> Path:
    loaded = load_model(source, mesh=make_mesh(), dtype=dtype)
    return save_checkpoint(
        Path(out),
        loaded.params,
        loaded.hf_config,
        loaded.tokenizer,
        dtype=jnp.dtype(loaded.dtype).name,
        source=loaded.name,
    )

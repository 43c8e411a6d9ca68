"""`jaxllm convert SRC --out checkpoints/NAME`: any readable model → an Orbax checkpoint that loads fast."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jaxllm.parallel.mesh import make_mesh
from jaxllm.weights import load_model, open_model
from jaxllm.weights.orbax import save_checkpoint


def convert(source: str | None, out: str, dtype: str = "auto") -> Path:
    """A float checkpoint of `source` (a GGUF's blocks dequantized: `quantization` applies when it is loaded)."""
    loaded = load_model(source, mesh=make_mesh(), dtype=dtype, quantization="none")
    return save_checkpoint(
        Path(out),
        loaded.params,
        loaded.hf_config,
        loaded.tokenizer,
        dtype=jnp.dtype(loaded.dtype).name,
        source=loaded.name,
    )


def export_tokenizer(source: str | None, out: str) -> Path:
    """The model's tokenizer alone, as Hugging Face tokenizer files, for tools that load one by path (lm-eval's
    `huggingface` backend, guidellm): the default model ships only a GGUF."""
    tokenizer = open_model(source).tokenizer()
    if tokenizer is None:
        raise ValueError(f"{source}: this model has no tokenizer")
    tokenizer.save_pretrained(out)
    return Path(out)

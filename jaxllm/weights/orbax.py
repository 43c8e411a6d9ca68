"""Orbax checkpoints written by `jaxllm convert`: the parameter tree as saved, loaded fast.

Layout of `checkpoints/NAME/`: `jaxllm.json` (marker: format version, dtype, source),
`config.json` (the HF config), `params/` (Orbax), and the tokenizer's files.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

MARKER = "jaxllm.json"
FORMAT_VERSION = 2  # 2: fused qkv_proj / gate_up_proj leaves


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def save_checkpoint(out: Path, params, hf_config: dict, tokenizer, *, dtype: str, source: str) -> Path:
    out = out.resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: already exists and is not empty; choose another --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", params)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    marker = {"format": "jaxllm-orbax", "version": FORMAT_VERSION, "dtype": dtype, "source": source}
    (out / MARKER).write_text(json.dumps(marker, indent=2))
    return out


def restore_params(path: Path, shapes, shardings):
    """Restore straight onto the mesh, cast to the dtypes of `shapes`."""
    marker = json.loads((path / MARKER).read_text())
    if marker.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: checkpoint format version {marker.get('version')} (this jaxllm reads "
            f"{FORMAT_VERSION}); convert the source model again with `jaxllm convert`"
        )
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            return ckpt.restore(path.resolve() / "params", target)
    except Exception as e:  # orbax raises many kinds on a damaged or mismatched checkpoint
        raise ValueError(f"{path}: cannot restore the Orbax checkpoint ({type(e).__name__}: {e})") from None

"""Converted weights kept on disk, so that a later start maps them instead of converting again.

Turning a GGUF file into the parameter tree (dequantize, transpose to `[in, out]`, fuse, stack
the layers) costs ~2-3 s of CPU for the default model at every start. The first start saves
the result, one `.npy` file per leaf, under `$JAXLLM_CACHE/weights/<key>/` (in a thread, while
the start goes on); later starts
memory-map them copy-on-write (nothing is read before a step touches it, nothing can write
the file) and, on CPU, hand them to XLA without a copy (`.npy` data is 64-byte aligned).
The key is the source file (path, size, mtime), the architecture, the dtype, the layout the step
asked for (the CPU kernel's packing: kept packed, a warm start does not pack again) and FORMAT:
raise FORMAT whenever the conversion (`params.py`, `gguf.py`) or a layout changes what it produces. Anything
missing or unreadable means convert again, and overwrite.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxllm.weights.default import cache_dir

logger = logging.getLogger(__name__)

FORMAT = 2
PAGE = 4096
_saving: dict[Path, threading.Thread] = {}  # folder → the thread writing it


def wait_for_saves() -> None:
    """Until every conversion started in this process is on disk (the interpreter also waits at exit)."""
    while _saving:
        _saving.pop(next(iter(_saving))).join()


def _folder(source: Path, arch, dtype, layout: str) -> Path:
    stat = source.stat()
    key = repr((str(source.resolve()), stat.st_size, stat.st_mtime_ns, repr(arch), np.dtype(dtype).str,
                str(np.dtype(dtype)), layout, FORMAT))
    return cache_dir() / "weights" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _leaf_name(key_path) -> str:
    return ".".join(str(k.key) for k in key_path) + ".npy"


def _bits(dtype: np.dtype) -> np.dtype:
    """The unsigned integer type of dtype's size: bfloat16 has no `.npy` type of its own, so bits are stored."""
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


def _load(folder: Path, shapes) -> Any:
    """The saved host arrays, memory-mapped, or None when any is missing or does not match its shape."""
    def leaf(key_path, shape):
        array = np.load(folder / _leaf_name(key_path), mmap_mode="c")
        if array.shape != shape.shape or array.dtype != _bits(shape.dtype):
            raise ValueError(f"{_leaf_name(key_path)}: {array.shape} {array.dtype}")
        return array.view(shape.dtype)

    try:
        return jax.tree_util.tree_map_with_path(leaf, shapes)
    except (OSError, ValueError, EOFError) as e:
        if folder.exists():
            logger.warning("converted weights in %s unreadable (%s); converting again", folder, e)
        return None


def _save(folder: Path, params) -> None:
    """Write every leaf's host copy; the folder appears whole or not at all."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=folder.parent, suffix=".partial"))
        for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            host = np.asarray(jax.device_get(leaf))
            np.save(partial / _leaf_name(key_path), host.view(_bits(host.dtype)))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    except Exception as e:  # a full or read-only disk costs the next start its conversion, nothing else
        logger.warning("could not keep the converted weights in %s: %s", folder, e)
        shutil.rmtree(partial, ignore_errors=True)


def load_or_convert(source: Path, arch, dtype, shapes, shardings, convert: Callable[[], Any], layout: str = "") -> Any:
    """The parameter tree of `source`: mapped from the saved conversion, else `convert()`ed and saved.
    `shapes` / `shardings`: the tree's ShapeDtypeStructs and shardings (params.abstract_params);
    `layout`: names the rearrangement `convert` applies, if any (weights.Layout)."""
    folder = _folder(source, arch, dtype, layout)
    if (writing := _saving.pop(folder, None)) is not None:
        writing.join()
    host = _load(folder, shapes)
    if host is None:
        params = convert()
        if all(leaf.is_fully_addressable for leaf in jax.tree.leaves(params)):  # multi-host: each has a part
            # written beside the start-up, not before it: ~5 s for the default model on a slow disk. Not a
            # daemon: a process that ends first still finishes the file (or leaves no folder, never half of one)
            _saving[folder] = threading.Thread(target=_save, args=(folder, params), name="jaxllm-save-weights")
            _saving[folder].start()
        return params
    for array in jax.tree.leaves(host):  # fault the pages in now, in the loading thread, not in the first step
        array.reshape(-1).view(np.uint8)[::PAGE].max(initial=0)
    # each process places only its own shards (as params_from_hf_tensors does)
    return jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda index: a[index]),
                        host, shardings)

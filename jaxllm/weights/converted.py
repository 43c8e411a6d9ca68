"""Converted weights kept on disk, so that a later start maps them instead of converting again.

Turning a GGUF file into the parameter tree (dequantize, transpose to `[in, out]`, fuse, stack
the layers, pack) costs seconds of CPU for the default model. The first start converts straight
into the kept files, one `.npy` file per leaf under `$JAXLLM_CACHE/weights/<key>/`, each mapped
writable: no second copy of the tree and no save pass (this VM faults fresh anonymous memory in
at ~100 MB/s, page-cache pages much faster: 6.1 -> 3.0 s for the default model's conversion).
A thread then flushes them and renames the folder into place while the start goes on. Later
starts memory-map them copy-on-write (nothing is read before a step touches it, nothing can
write the file) and, on CPU, hand them to XLA without a copy (`.npy` data is 64-byte aligned).
The key is the source file (path, size, mtime), the architecture, the dtype, the layout the step
asked for (the CPU kernel's packing: kept packed, a warm start does not pack again) and FORMAT:
raise FORMAT whenever the conversion (`params.py`, `gguf.py`) or a layout changes what it produces. Anything
missing or unreadable means convert again, and overwrite. A conversion logs a line when it starts and draws a bar
of the leaves converted (`pallas_kernels.progress`: while the engine's progress is on).

Each variant (quantization, layout, dtype) is a folder of its own, 90-540 MB for the default model, so
the folders are bounded: once a new one is kept, the least recently used others are deleted until all
fit in `$JAXLLM_WEIGHTS_CACHE_GB` (default 8; a load marks its folder used). The folders this process
loaded or wrote are never deleted by it. `jaxllm cache info` lists them (each has a `source.json`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxllm.weights.default import cache_dir
from jaxllm.weights.params import Allocate, aligned_empty, leaf_path, place
from pallas_kernels import progress

logger = logging.getLogger(__name__)

FORMAT = 2
PAGE = 4096
WEIGHTS_CACHE_GB_ENV = "JAXLLM_WEIGHTS_CACHE_GB"
DEFAULT_WEIGHTS_CACHE_GB = 8.0
ABANDONED_S = 3600.0  # a `.partial` folder untouched this long was left by a process that died writing it
DESCRIPTION = "source.json"  # what a folder holds, for `jaxllm cache info`
_saving: dict[Path, threading.Thread] = {}  # folder → the thread writing it
_in_use: set[Path] = set()  # folders this process loaded or wrote: never evicted by it


def wait_for_saves() -> None:
    """Until every conversion started in this process is on disk (the interpreter also waits at exit)."""
    while _saving:
        _saving.pop(next(iter(_saving))).join()


def _folder(source: Path, arch, dtype, layout: str) -> Path:
    stat = source.stat()
    key = repr(
        (
            str(source.resolve()),
            stat.st_size,
            stat.st_mtime_ns,
            repr(arch),
            np.dtype(dtype).str,
            str(np.dtype(dtype)),
            layout,
            FORMAT,
        )
    )
    return weights_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]


def weights_dir() -> Path:
    return cache_dir() / "weights"


def bound_bytes() -> int:
    """The converted weights' size bound: `$JAXLLM_WEIGHTS_CACHE_GB` GB (default 8)."""
    value = os.environ.get(WEIGHTS_CACHE_GB_ENV, "")
    try:
        gb = float(value) if value else DEFAULT_WEIGHTS_CACHE_GB
    except ValueError:
        raise ValueError(f"${WEIGHTS_CACHE_GB_ENV} must be a number of GB, got {value!r}") from None
    if gb < 0:
        raise ValueError(f"${WEIGHTS_CACHE_GB_ENV} must be 0 or more GB, got {value!r}")
    return int(gb * 1e9)


def folder_size(folder: Path) -> int:
    """Bytes of the files under `folder` (0 when it is gone)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # deleted meanwhile
    return total


def entries() -> list[tuple[Path, int, float, dict]]:
    """The kept conversions, least recently used first: (folder, bytes, last use as a timestamp, what it
    holds: the source.json written with it, {} for older folders)."""
    found = []
    try:
        folders = [f for f in weights_dir().iterdir() if f.is_dir() and not f.name.endswith(".partial")]
    except OSError:
        return []
    for folder in folders:
        try:
            used = folder.stat().st_mtime
        except OSError:
            continue
        try:
            description = json.loads((folder / DESCRIPTION).read_text())
        except (OSError, ValueError):
            description = {}
        found.append((folder, folder_size(folder), used, description))
    return sorted(found, key=lambda entry: entry[2])


def evict(bound: int | None = None) -> list[Path]:
    """Delete the least recently used conversions until the rest fit in `bound` bytes (default `bound_bytes()`),
    never one this process uses, and `.partial` folders abandoned by a process that died writing them.
    Returns the folders deleted."""
    bound = bound_bytes() if bound is None else bound
    deleted = []
    now = time.time()
    for partial in weights_dir().glob("*.partial"):
        try:
            if now - partial.stat().st_mtime > ABANDONED_S:
                shutil.rmtree(partial, ignore_errors=True)
                deleted.append(partial)
        except OSError:
            pass
    kept = entries()
    total = sum(size for _, size, _, _ in kept)
    for folder, size, _, _ in kept:
        if total <= bound:
            break
        if folder in _in_use or folder in _saving:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        deleted.append(folder)
        logger.info(
            "deleted the converted weights in %s (%.0f MB, least recently used): over $%s=%.1f GB",
            folder,
            size / 1e6,
            WEIGHTS_CACHE_GB_ENV,
            bound / 1e9,
        )
    return deleted


def _mark_used(folder: Path) -> None:
    """A load: this folder is the most recently used (its mtime orders eviction)."""
    _in_use.add(folder)
    try:
        os.utime(folder)
    except OSError:
        pass  # a read-only cache: the order is only less exact


def _leaf_name(path: tuple[str, ...]) -> str:
    return ".".join(path) + ".npy"


def _bits(dtype: np.dtype) -> np.dtype:
    """The unsigned integer type of dtype's size: bfloat16 has no `.npy` type of its own, so bits are stored."""
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


def _load(folder: Path, shapes) -> Any:
    """The saved host arrays, memory-mapped, or None when any is missing or does not match its shape."""

    def leaf(key_path, shape):
        name = _leaf_name(leaf_path(key_path))
        array = np.load(folder / name, mmap_mode="c")
        if array.shape != shape.shape or array.dtype != _bits(shape.dtype):
            raise ValueError(f"{name}: {array.shape} {array.dtype}")
        return array.view(shape.dtype)

    try:
        return jax.tree_util.tree_map_with_path(leaf, shapes)
    except (OSError, ValueError, EOFError) as e:
        if folder.exists():
            logger.warning("converted weights in %s unreadable (%s); converting again", folder, e)
        return None


class _Writer:
    """The folder being converted into: `allocate` gives each leaf as a new `.npy` file mapped writable (in
    memory when the cache cannot take it: the next start converts again, nothing else is lost); `keep` flushes
    them and renames the folder into place, so that it appears whole or not at all."""

    def __init__(self, folder: Path, description: dict):
        self.folder = folder
        self.files: list[np.memmap] = []  # the mapped .npy files, flushed by `keep`
        self.partial: Path | None = None  # the folder being written, renamed into place by `keep`
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            self.partial = Path(tempfile.mkdtemp(dir=folder.parent, suffix=".partial"))
            (self.partial / DESCRIPTION).write_text(json.dumps(description))
        except OSError as e:
            self._give_up(e)

    def allocate(self, path: tuple[str, ...], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if self.partial is not None:
            file = self.partial / _leaf_name(path)
            try:
                array = np.lib.format.open_memmap(file, "w+", _bits(dtype), shape)
                fd = os.open(file, os.O_RDWR)
                try:  # a full disk fails here, not as a SIGBUS at some later write into the mapping
                    os.posix_fallocate(fd, 0, file.stat().st_size)
                finally:
                    os.close(fd)
                self.files.append(array)
                return array.view(dtype)
            except OSError as e:
                self._give_up(e)
        return aligned_empty(path, shape, dtype)

    def _give_up(self, error: OSError) -> None:
        logger.warning("could not keep the converted weights in %s: %s", self.folder, error)
        self.discard()

    def discard(self) -> None:
        if self.partial is not None:  # mapped files stay readable until unmapped
            shutil.rmtree(self.partial, ignore_errors=True)
        self.partial, self.files = None, []

    def keep(self) -> None:
        partial = self.partial
        if partial is None:
            return

        def flush():
            try:
                for array in self.files:
                    array.flush()
                shutil.rmtree(self.folder, ignore_errors=True)
                os.replace(partial, self.folder)
            except OSError as e:
                self._give_up(e)
                return
            _in_use.add(self.folder)
            try:
                evict()
            except (OSError, ValueError) as e:
                logger.warning("could not bound the converted weights in %s: %s", self.folder.parent, e)

        # beside the start, not before it. Not a daemon: a process that ends first still finishes the folder
        _saving[self.folder] = threading.Thread(target=flush, name="jaxllm-save-weights")
        _saving[self.folder].start()


def load_or_convert(
    source: Path, arch, dtype, shapes, shardings, layout: str, convert: Callable[[Allocate], Any]
) -> Any:
    """The parameter tree of `source`: mapped from the kept conversion, else `convert(allocate)`ed (host arrays
    from `allocate`) and kept. `shapes` / `shardings`: the tree's ShapeDtypeStructs and shardings
    (params.abstract_params); `layout`: names the rearrangement `convert` applies, if any (params.Layout)."""
    folder = _folder(source, arch, dtype, layout)
    if (writing := _saving.pop(folder, None)) is not None:
        writing.join()
    host = _load(folder, shapes)
    if host is None:
        # multi-host: each process holds a part, and a shared cache would see several writers
        description = {"source": str(source), "dtype": str(np.dtype(dtype)), "layout": layout, "format": FORMAT}
        fully_addressable = all(s.is_fully_addressable for s in jax.tree.leaves(shardings))
        writer = _Writer(folder, description) if fully_addressable else None
        allocate = writer.allocate if writer else aligned_empty
        leaves = len(jax.tree.leaves(shapes))
        logger.info(
            "converting %s into %d %s arrays (layout %s): first use, a few seconds; kept in %s",
            source.name,
            leaves,
            np.dtype(dtype),
            layout.split("/")[0] or "none",  # its name (then the quantization plan's)
            folder.parent if writer else "memory only",
        )
        begun = 0

        def allocate_counted(path: tuple[str, ...], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            nonlocal begun
            bar.update(1 if begun else 0)  # `convert` allocates each leaf as it starts it: the one before is done
            bar.set_postfix_str(".".join(path), refresh=False)
            begun += 1
            return allocate(path, shape, dtype)

        try:
            with progress.bar(leaves, "Converting weights", "array") as bar:
                host = convert(allocate_counted)
                bar.update(leaves - bar.n)
        except BaseException:
            if writer:
                writer.discard()
            raise
        if writer:
            writer.keep()
    else:
        _mark_used(folder)
        for array in jax.tree.leaves(host):  # fault the pages in now, in the loading thread, not in the first step
            array.reshape(-1).view(np.uint8)[::PAGE].max(initial=0)
    return place(host, shardings)

"""Compiled step executables on disk, so a warm start skips tracing and lowering.

JAX's persistent compilation cache is keyed by the lowered HLO: to find an executable in
it, every bucket must first be traced and lowered again (~1.5 s a bucket on a 2-core CPU,
most of a warm start). This cache is keyed instead by everything that decides the step's
graph, known before tracing: the source files the step can be built from, the versions of
jax/jaxlib/flax/numpy, the backend and its devices, XLA flags and JAX's settings, the
model's static configuration, and the shapes, dtypes and shardings of every argument.
A hit deserializes the executable (~0.2 s); anything else misses and compiles as before.

Only freshly compiled executables are stored: on CPU, an executable that JAX loaded from its
own cache serializes without its object code (jaxlib 0.10; it fails at run time with
"Function ... not found"), so a compile served by JAX's cache is not written here. The step
function is named after the fingerprint (`ModelRunner`), so a fingerprint this cache has
not seen is a module JAX's cache has not seen either, and compiles fresh.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from jaxllm.runner.compilations import served_by_jax_cache

logger = logging.getLogger(__name__)
# XLA's CPU client is not safe to (de)serialize executables beside other work: two `load`s side by side, then a
# `load` beside compiles and a weight-reading thread, crashed the process (a segfault in `deserialize_executable`,
# CI, jaxlib 0.10). Loads and stores take turns under this lock; `ModelRunner` loads before anything else runs and
# stores after its compiles are done, in its own thread.
_serializing = threading.Lock()

_PACKAGES = ("jax", "jaxlib", "flax", "numpy")
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
# subpackages that only feed the step arrays (whose shapes, dtypes and shardings are in the key) or never
# reach it: left out of the source hash, so that editing them keeps compiled steps valid. Everything else
# (the model, the runner and its sampler, the kernels, sharding, top-level settings, any new subpackage)
# may change the graph and is hashed.
_HOST_ONLY = {
    "engine",
    "weights",
    "structured",
    "distributed",
    "entrypoints",
    "bench",
    "sim",
    "metrics",
    "integrations",
}
_FORMAT = b"jaxllm-executable-2"  # then the payload's sha256, then the payload


# XLA CPU compiles a step's ~200-270 elementwise fusions through its MLIR fusion emitters and LLVM at -O2. The
# older direct-to-LLVM emitters at -O1 compile the default model's buckets in ~30 % less CPU time (T=1: 4.1 ->
# 2.5 s, T=16: 5.5 -> 3.5 s, T=512: 6.1 -> 4.4 s) with the same step time (T=1 ~40 ms, T=64 ~290 ms): the
# matmuls and attention are library calls and C++ kernels that these options do not touch. benchmarks/NOTES.md.
CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}


def compiler_options() -> dict:
    """XLA options the steps compile with on this backend (they are in this module's source, so in the key)."""
    return dict(CPU_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}


def _source_digest() -> bytes:
    """One hash of the source files of jaxllm (but its host-only parts) and of the kernels."""
    import jaxllm
    import pallas_kernels

    digest = hashlib.sha256()
    for package in (jaxllm, pallas_kernels):
        assert package.__file__ is not None  # regular packages, not namespace ones
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*")):
            parts = path.relative_to(root).parts
            if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in parts and parts[0] not in _HOST_ONLY:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def environment_fingerprint() -> str:
    """What every executable of this process shares: code, versions, backend, devices, flags, settings."""
    backend = jax.devices()[0].client
    parts = [
        _FORMAT,
        _source_digest(),
        *(f"{p}=={importlib.metadata.version(p)}".encode() for p in _PACKAGES),
        f"{backend.platform} {backend.platform_version}".encode(),
        repr([(d.id, d.device_kind, d.process_index) for d in jax.devices()]).encode(),
        os.environ.get("XLA_FLAGS", "").encode(),
        repr(sorted((k, repr(v)) for k, v in jax.config.values.items())).encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


def fingerprint(*parts) -> str:
    """A short key from `repr` of each part (the environment fingerprint, the model, the arguments' shapes...)."""
    return hashlib.sha256("\0".join(map(repr, parts)).encode()).hexdigest()[:32]


def abstract_signature(args) -> str:
    """Tree structure, shapes, dtypes and shardings of a call's arguments (arrays or ShapeDtypeStructs)."""
    leaves, tree = jax.tree.flatten(args)
    return repr(tree) + repr([(x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves])


class ExecutableCache:
    """`key` → a `jax.stages.Compiled`, one file per key in `folder` (None: nothing is stored or found)."""

    def __init__(self, folder: str | os.PathLike | None):
        self.folder = Path(folder) if folder else None

    def _path(self, key: str) -> Path:
        assert self.folder is not None, "no folder: nothing is stored or found"
        return self.folder / f"{key}.bin"

    def load(self, key: str, devices):
        """The stored executable, loaded onto `devices` (those it was compiled for, in the mesh's order),
        or None: absent, unreadable or from another jaxlib all mean compile."""
        if self.folder is None:
            return None
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            start = len(_FORMAT) + 32  # the format, the payload's sha256, the payload
            digest, body = blob[len(_FORMAT) : start], blob[start:]
            if blob[: len(_FORMAT)] != _FORMAT or hashlib.sha256(body).digest() != digest:  # never handed to XLA
                raise ValueError("not a whole executable of this format")
            payload, in_tree, out_tree = pickle.loads(body)
            with _serializing:
                return serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=list(devices)
                )
        except Exception as e:  # a truncated file or an incompatible blob: recompile and overwrite it
            logger.warning("cached executable %s unreadable (%s: %s); compiling", path.name, type(e).__name__, e)
            return None

    @staticmethod
    def compile(lowered) -> tuple[Any, bool]:
        """`lowered` compiled, and whether it was compiled here: only such an executable may be `store`d (one
        served by JAX's cache serializes without its object code)."""
        served_by_jax_cache.hit = False
        compiled = lowered.compile(compiler_options())
        return compiled, not served_by_jax_cache.hit

    def store(self, key: str, compiled) -> None:
        """Write `compiled` (freshly compiled: `compile`) under `key`; call it while nothing else compiles."""
        if self.folder is None:
            return
        try:
            with _serializing:
                body = pickle.dumps(serialize_executable.serialize(compiled))
            blob = _FORMAT + hashlib.sha256(body).digest() + body
            path = self._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".partial", delete=False) as f:
                f.write(blob)
            os.replace(f.name, path)  # atomic: a concurrent reader never sees half a file
        except Exception as e:  # a read-only or full disk costs the next start its compile, nothing else
            logger.warning("could not store the compiled step %s: %s", key, e)

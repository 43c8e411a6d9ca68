"""The CPU kernel: ragged paged attention as an XLA FFI custom call written in C++.

Why not jnp: XLA's CPU gather emitter copies ~2.5-3 GB/s however the paged read is phrased
(a gather of whole [B, Hkv, D] blocks, of flat rows, with `promise_in_bounds`, in a loop of
small gathers), while a dynamic-slice or a plain reduction reads ~20-26 GB/s on the same
machine; and a loop that reads blocks with dynamic slices pays XLA's per-op overhead on tiny
einsums (measured slower than the reference; `benchmarks/NOTES.md`, "Decode attention (CPU)").
A paged read is a pointer chase plus a few dot products per key: plain C++ does it at memory
speed, as vLLM's CPU backend does.

`cpu_kernel.cc` is compiled on first use with the system C++ compiler into a cache
directory (`$JAXLLM_CACHE_DIR`, else `~/.cache/jaxllm`), keyed by the source, the compiler
flags, jaxlib's version and the CPU, then registered with XLA. Without a compiler
`available()` is False and "auto" dispatch keeps the jnp reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "jaxllm_ragged_paged_attention_cpu"
SOURCE = Path(__file__).with_name("cpu_kernel.cc")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXLLM_CACHE_DIR") or Path.home() / ".cache" / "jaxllm") / "kernels"


def _build() -> Path:
    import jaxlib

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler (set CXX)")
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(),
                                     _cpu_id().encode(), compiler.encode()])).hexdigest()[:16]
    lib = _cache_dir() / f"ragged_paged_attention_cpu-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp_lib)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp_lib, lib)  # atomic: concurrent builders never load a half-written file
    return lib


def supports(k_cache) -> bool:
    return jnp.dtype(k_cache.dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@functools.cache
def available() -> bool:
    """Build (once per machine) and register the kernel; False, with a warning, if that fails."""
    # OpenMP workers sleep between calls instead of spinning: the CPU is shared with XLA's
    # own threads (and, on a busy host, with other processes). Read when libgomp loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.RaggedPagedAttentionCpu), platform="cpu")
    except Exception as e:  # no compiler, no headers, a sandbox: the jnp reference still works
        logger.warning("CPU attention kernel unavailable, using the jnp reference: %s", e)
        return False
    return True


def ragged_paged_attention_cpu(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None, layer=None):
    """The reference's contract; caches float32 or bfloat16; computes in float32."""
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built (see the warning above)")
    if not supports(k_cache):
        raise ValueError(f"the CPU kernel reads float32 or bfloat16 caches, got {k_cache.dtype}")
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_cache, v_cache, i32(kv_lens), i32(block_tables), i32(cu_q_lens),
        jnp.reshape(i32(num_seqs), (-1,))[:1], jnp.reshape(i32(0 if layer is None else layer), (1,)),
        sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)

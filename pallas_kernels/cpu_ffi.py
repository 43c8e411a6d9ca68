"""Building and registering jaxllm's C++ CPU kernels (XLA FFI custom calls).

Each kernel is one C++ file (and the headers beside this module) compiled on first use with the
system compiler for `-march=$JAXLLM_CPU_MARCH` (default native) into a cache directory
(`$JAXLLM_CACHE/kernels`, `$JAXLLM_CACHE` defaulting to `~/.cache/jaxllm` as everywhere in jaxllm),
keyed by the sources, the compiler flags and target, jaxlib's version and the CPU, then registered
with XLA under a target name. Without a compiler `register` returns False (with a warning) and
callers keep their jnp path. A build logs a line at INFO when it starts (the one silent step of a first start
otherwise) and when it ends.
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
import time
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-ffast-math", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd"]
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # shared by the kernels (cpu_simd.h: vector width per target)


def march() -> str:
    """The target the kernels are compiled for: `$JAXLLM_CPU_MARCH`, default "native" (this CPU); e.g.
    "x86-64-v3" builds the AVX2 code and "x86-64-v2" the SSE one on any x86 machine, to test and time them."""
    return os.environ.get("JAXLLM_CPU_MARCH") or "native"


def flags() -> list[str]:
    return [*FLAGS, f"-march={march()}"]


@functools.cache
def isa() -> str:
    """The vector ISA the kernels are built for (cpu_simd.h's choice), from the compiler's own macros for
    `-march=march()`: "AVX-512+BF16", "AVX-512", "AVX2+FMA", "NEON", "SSE" or "generic"."""
    compiler = _compiler()
    if not compiler:
        return "no compiler"
    done = subprocess.run(
        [compiler, f"-march={march()}", "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True
    )
    macros = set(line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define "))
    if "__AVX512F__" in macros:
        return "AVX-512+BF16" if "__AVX512BF16__" in macros else "AVX-512"
    if "__AVX2__" in macros:
        return "AVX2+FMA" if "__FMA__" in macros else "AVX2"
    for macro, name in (("__AVX__", "AVX"), ("__aarch64__", "NEON"), ("__SSE2__", "SSE")):
        if macro in macros:
            return name
    return "generic"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("JAXLLM_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxllm"
    return Path(root) / "kernels"


def build(source: Path) -> Path:
    """The shared library of `source`, compiled now unless this machine already has it."""
    import jaxlib

    compiler = _compiler()
    if not compiler:
        raise RuntimeError("no C++ compiler (set CXX)")
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(h.read_bytes() for h in HEADERS),
                " ".join(flags()).encode(),
                jaxlib.__version__.encode(),
                _cpu_id().encode(),
                compiler.encode(),
            ]
        )
    ).hexdigest()[:16]
    lib = cache_dir() / f"{source.parent.name}-{source.stem}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info(
        "building the CPU kernel %s/%s for %s (-march=%s): first use on this machine, a compiler run of ~5-10 s",
        source.parent.name,
        source.name,
        isa(),
        march(),
    )
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [compiler, *flags(), f"-I{jax.ffi.include_dir()}", str(source), "-o", str(tmp_lib)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp_lib, lib)  # atomic: concurrent builders never load a half-written file
    logger.info("built %s in %.1fs", lib, time.perf_counter() - started)
    return lib


@functools.cache
def register(source: Path, symbol: str, target: str) -> bool:
    """Build `source` (once per machine) and register its handler `symbol` as FFI `target`; False if that fails."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source)))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # no compiler, no headers, a sandbox: the jnp paths still work
        logger.warning("CPU kernel %s unavailable, using the jnp path: %s", target, e)
        return False
    return True

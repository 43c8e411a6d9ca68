"""Building and registering jaxllm's C++ CPU kernels (XLA FFI custom calls).

Each kernel is one C++ file, its FFI handlers, that includes its jobs as headers (the stacked matmul's
float and quantized kernels, the attention's units) and the shared ones beside this module
(cpu_simd.h: every choice by instruction set; cpu_team.h: the threads): one translation unit per
kernel, so one compiler run, no link step, and the compiler inlines across the jobs as it did when
they were one file. It is compiled on first use with the system compiler for
`-march=$JAXLLM_CPU_MARCH` (default native) into a cache directory (`$JAXLLM_CACHE/kernels`,
`$JAXLLM_CACHE` defaulting to `~/.cache/jaxllm` as everywhere in jaxllm), keyed by every file the
compiler reads of ours (`sources`: the .cc and each header it includes by a quoted name, transitively,
wherever it lives, jaxlib's FFI headers too), the compiler flags and target, jaxlib's version and
the CPU, then registered with XLA under a target name. Without a compiler `register` returns False
(with a warning) and callers keep their jnp path. A build logs a line at INFO when it starts (the one
silent step of a first start otherwise) and when it ends; `prebuild` starts several at once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-ffast-math", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd"]
_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def march() -> str:
    """The target the kernels are compiled for: `$JAXLLM_CPU_MARCH`, default "native" (this CPU); e.g.
    "x86-64-v3" builds the AVX2 code and "x86-64-v2" the SSE one on any x86 machine, to test and time them."""
    return os.environ.get("JAXLLM_CPU_MARCH") or "native"


def flags() -> list[str]:
    return [*FLAGS, f"-march={march()}"]


@functools.cache
def target_macros() -> frozenset[str]:
    """The compiler's predefined macros for `-march=march()` (empty without a compiler): what the kernels'
    `#if`s see."""
    compiler = find_compiler()
    if not compiler:
        return frozenset()
    done = subprocess.run(
        [compiler, f"-march={march()}", "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True
    )
    return frozenset(line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define "))


@functools.cache
def isa() -> str:
    """The vector ISA the kernels are built for (cpu_simd.h's choice), from the compiler's own macros for
    `-march=march()`: "AVX-512+BF16", "AVX-512", "AVX2+FMA", "NEON", "SSE" or "generic", with "+VNNI" or
    "+dotprod" where the target has integer dot instructions (AVX512-VNNI or AVX-VNNI; armv8.2-a's sdot)."""
    if not find_compiler():
        return "no compiler"
    macros = target_macros()
    # the integer dot instructions the quantized kernel's integer path takes (cpu_simd.h's kIntDot)
    dot = "+dotprod" if "__ARM_FEATURE_DOTPROD" in macros else ""
    dot = "+VNNI" if macros & {"__AVX512VNNI__", "__AVXVNNI__"} else dot
    if "__AVX512F__" in macros:
        return ("AVX-512+BF16" if "__AVX512BF16__" in macros else "AVX-512") + dot
    if "__AVX2__" in macros:
        return ("AVX2+FMA" if "__FMA__" in macros else "AVX2") + dot
    for macro, name in (("__AVX__", "AVX"), ("__aarch64__", "NEON"), ("__SSE2__", "SSE")):
        if macro in macros:
            return name + dot
    return "generic"


def find_compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else c++ or g++ on the PATH (None: none here)."""
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


def include_dirs() -> list[Path]:
    """The directories the kernels' compiler run searches (-I) beyond the including file's own: jaxlib's FFI headers."""
    return [Path(jax.ffi.include_dir())]


def sources(source: Path) -> list[Path]:
    """`source` and every file it includes by a quoted name (`#include "..."`), transitively, found where the
    compiler finds it (beside the including file, then in `include_dirs`), in the order first included: what a
    build reads of ours and of jaxlib's, wherever it lives. An include inside an `#if` counts whether or not the
    target takes it; `<...>` includes are the compiler's own (its path is in the build key)."""
    found = [source.resolve()]
    for path in found:  # grows as it goes: breadth first
        for name in _QUOTED_INCLUDE.findall(path.read_text()):
            for where in (path.parent, *include_dirs()):
                header = (where / name).resolve()
                if header.is_file():
                    if header not in found:
                        found.append(header)
                    break
    return found


def library(source: Path, compiler: str | None = None) -> Path:
    """Where the build of `source` with `compiler` (default: the one `build` runs) for this target lives, built or
    not: named by a hash of every file in `sources(source)`, the flags and target, jaxlib's version, the CPU and
    the compiler."""
    import jaxlib

    compiler = compiler or find_compiler() or ""
    key = hashlib.sha256(
        b"\0".join(
            [
                *(path.read_bytes() for path in sources(source)),
                " ".join(flags()).encode(),
                jaxlib.__version__.encode(),
                _cpu_id().encode(),
                compiler.encode(),
            ]
        )
    ).hexdigest()[:16]
    return cache_dir() / f"{source.parent.name}-{source.stem}-{key}.so"


_lock = threading.Lock()
_builds: dict[Path, Future[Path]] = {}  # library -> its compiler run in this process (done or not; failed: its error)


def build(source: Path) -> Path:
    """The shared library of `source`, compiled now unless this machine already has it. A build of the same
    library under way in this process (`prebuild`) is waited for rather than started again."""
    compiler = find_compiler()
    if not compiler:
        raise RuntimeError("no C++ compiler (set CXX)")
    lib = library(source, compiler)
    if lib.exists():
        return lib
    with _lock:
        under_way = _builds.get(lib)
        if under_way is None:
            run: Future[Path] = Future()
            _builds[lib] = run
    if under_way is not None:
        return under_way.result()
    try:
        _compile(compiler, source, lib)
    except BaseException as e:
        run.set_exception(e)
        raise
    run.set_result(lib)
    return lib


def _compile(compiler: str, source: Path, lib: Path) -> None:
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
        cmd = [compiler, *flags(), *(f"-I{d}" for d in include_dirs()), str(source), "-o", str(tmp_lib)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp_lib, lib)  # atomic: concurrent builders never load a half-written file
    logger.info("built %s in %.1fs", lib, time.perf_counter() - started)


def prebuild(*sources: Path) -> None:
    """Start building each of `sources` that this machine lacks, each in a thread of its own, and return: a cold
    start's compiler runs (~5-10 s each) then overlap, instead of running one after the other as each kernel is
    first registered (the compiler is a subprocess: the threads hold no GIL while it runs). `build` and
    `register` of a source being built wait for its run; a failed one is reported by them, not here. A source
    this process has registered already is skipped: `register` builds once per process, so nothing would
    wait for such a run."""
    for source in sources:
        if source in _registered:
            continue
        threading.Thread(target=_build_quietly, args=(source,), name=f"build-{source.parent.name}", daemon=True).start()


def _build_quietly(source: Path) -> None:
    try:
        build(source)
    except Exception as e:  # raised again to whoever waits on it (build), which reports it
        logger.debug("prebuild of %s failed: %s", source, e)


_registered: set[Path] = set()  # sources `register` was called for (prebuild leaves them be)


@functools.cache
def register(source: Path, symbol: str, target: str) -> bool:
    """Build `source` (once per machine) and register its handler `symbol` as FFI `target`; False if that fails."""
    _registered.add(source)
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source)))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # no compiler, no headers, a sandbox: the jnp paths still work
        logger.warning("CPU kernel %s unavailable, using the jnp path: %s", target, e)
        return False
    return True

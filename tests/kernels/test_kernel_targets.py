"""The C++ kernels built for every target they have code for, checked against a float64 oracle.

`cross/harness.cc` includes both kernel sources and checks their values (stacked matmul: streamed,
panels, packed float32 and bfloat16; ragged paged attention: float32 and bfloat16 caches, NaN in
every block and row a sequence does not own) against a float64 oracle of its own. On x86-64 it is
built for this CPU (`-march=native`), for x86-64-v3 (the AVX2 code) and x86-64-v2 (the SSE code),
so every machine checks the paths its own CPU would not take, and for the integer dot instructions of the
quantized kernel's integer path (int_panels.h): skylake-avx512 (AVX-512 without VNNI: pmaddubsw) and alderlake
(AVX2 with AVX-VNNI), run where this CPU has them and only compiled elsewhere; for ARM64 (NEON), which has no
machine here, with Debian's aarch64 cross compiler, run under qemu-aarch64 with and without armv8.2-a's dotprod
(sdot); every kernel source also builds for aarch64 as a shared object, as `cpu_ffi.py` builds it. CI installs
the tools with `.ci/install_cross_tools.sh`.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import pytest

from pallas_kernels import cpu_ffi

HARNESS = Path(__file__).with_name("cross") / "harness.cc"
KERNELS = sorted(Path(cpu_ffi.__file__).parent.glob("*/*.cc"))
CROSS_CXX, QEMU, ARM_MARCH, ARM_DOTPROD = "aarch64-linux-gnu-g++", "qemu-aarch64", "armv8-a", "armv8.2-a+dotprod"
HAVE_CROSS = bool(shutil.which(CROSS_CXX) and shutil.which(QEMU))
# x86-64 targets any x86-64 machine runs, and the vector code cpu_simd.h picks for each
X86_TARGETS = {"x86-64-v3": "AVX2+FMA", "x86-64-v2": "SSE"} if platform.machine() == "x86_64" else {}
# the integer dot code each target takes (cpu_simd.h's kIntDot), and for the targets below the CPU flag that runs it
INT_DOT = {"x86-64-v3": "pmaddubsw", "x86-64-v2": "pmaddubsw"}
INT_DOT |= {"armv8-a": "NEON smull", "armv8.2-a+dotprod": "NEON sdot"}
X86_DOT_TARGETS = (
    {"skylake-avx512": ("AVX-512", "pmaddubsw", "avx512bw"), "alderlake": ("AVX2+FMA", "AVX-VNNI", "avx_vnni")}
    if platform.machine() == "x86_64"
    else {}
)
MISSING = f"no {CROSS_CXX} or {QEMU}: run .ci/install_cross_tools.sh (apt: g++-aarch64-linux-gnu qemu-user)"
# skipped without the tools, except in CI, which installs them: there the NEON path must not go silently unchecked
needs_cross = pytest.mark.skipif(not HAVE_CROSS and os.environ.get("CI") != "true", reason=MISSING)


def executable_flags(march: str) -> list[str]:
    """The kernels' compiler flags (cpu_ffi.py), for an executable rather than a shared object."""
    return [f for f in cpu_ffi.FLAGS if f not in ("-shared", "-fPIC")] + ["-pthread", f"-march={march}"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every build this module checks, started at once (seconds each, all in the compiler); `build` waits for one."""
    out = tmp_path_factory.mktemp("cross")
    native_cxx = cpu_ffi.find_compiler()
    assert native_cxx, "no C++ compiler (a test requirement, as for the kernels themselves)"
    specs = {"native": (native_cxx, [*executable_flags(cpu_ffi.march()), str(HARNESS)], out / "harness")}
    for march in [*X86_TARGETS, *X86_DOT_TARGETS]:
        specs[march] = (native_cxx, [*executable_flags(march), str(HARNESS)], out / f"harness-{march}")
    if HAVE_CROSS:
        specs["aarch64"] = (CROSS_CXX, [*executable_flags(ARM_MARCH), "-static", str(HARNESS)], out / "harness-arm")
        specs["aarch64-dotprod"] = (
            CROSS_CXX,
            [*executable_flags(ARM_DOTPROD), "-static", str(HARNESS)],
            out / "harness-arm-dotprod",
        )
        for source in KERNELS:  # exactly as cpu_ffi.build would, for aarch64
            so = out / f"{source.parent.name}-aarch64.so"
            specs[source.parent.name] = (CROSS_CXX, [*cpu_ffi.FLAGS, f"-march={ARM_MARCH}", str(source)], so)
    jobs = {}
    for name, (cxx, args, target) in specs.items():
        cmd = [cxx, *args, f"-I{jax.ffi.include_dir()}", "-o", str(target)]
        log = out / f"{name}.log"
        with open(log, "w") as f:
            jobs[name] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT), cmd, log, target)
    yield jobs
    for proc, *_ in jobs.values():
        proc.kill()  # only if a test failed before waiting for it


def build(builds, name: str) -> Path:
    assert name in builds, MISSING
    proc, cmd, log, target = builds[name]
    assert proc.wait() == 0, f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}"
    return target


def run_harness(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(done.stdout)  # one line per case: shown by pytest on failure
    assert done.returncode == 0 and done.stdout.rstrip().endswith(" 0 failed"), done.stdout[-3000:] + done.stderr
    return done.stdout


def test_harness_natively(builds):
    run_harness([str(build(builds, "native"))])


@pytest.mark.parametrize("march", sorted(X86_TARGETS))
def test_harness_for_each_x86_target(builds, march):
    out = run_harness([str(build(builds, march))])
    first = out.splitlines()[0]
    assert first.startswith(f"isa {X86_TARGETS[march]},"), f"{march} built other code: {first}"
    assert first.endswith(f"integer dot {INT_DOT[march]}"), first


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":")[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.parametrize("march", sorted(X86_DOT_TARGETS))
def test_harness_for_each_integer_dot_target(builds, march):
    """Built everywhere; run where this CPU has the instructions (a VNNI machine runs both)."""
    isa, dot, flag = X86_DOT_TARGETS[march]
    binary = build(builds, march)
    if flag not in cpu_flags():
        pytest.skip(f"built for {march}; this CPU lacks {flag} to run it")
    first = run_harness([str(binary)]).splitlines()[0]
    assert first.startswith(f"isa {isa},") and first.endswith(f"integer dot {dot}"), first


@needs_cross
@pytest.mark.parametrize("build_name, march", [("aarch64", ARM_MARCH), ("aarch64-dotprod", ARM_DOTPROD)])
def test_harness_on_aarch64_under_qemu(builds, build_name, march):
    out = run_harness([QEMU, str(build(builds, build_name))])
    first = out.splitlines()[0]
    assert first.startswith("isa NEON,"), f"the aarch64 build did not use NEON: {first}"
    assert first.endswith(f"integer dot {INT_DOT[march]}"), first


@needs_cross
@pytest.mark.parametrize("kernel", [k.parent.name for k in KERNELS])
def test_kernel_compiles_for_aarch64(builds, kernel):
    with open(build(builds, kernel), "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183, "not an aarch64 ELF object"

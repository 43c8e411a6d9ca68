"""Building the C++ kernels (`pallas_kernels.cpu_ffi`): the build key covers every file a kernel includes, wherever
it lives, and `prebuild` runs the compiler for several kernels at once, each library built once. On tiny source
trees of their own (the real kernels take ~10 s each to compile), but for the check that the real kernels' keys
cover every header of `pallas_kernels`."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from pallas_kernels import cpu_ffi, stacked_matmul
from pallas_kernels.ragged_paged_attention import cpu as attention_cpu

BUILDING = "building the CPU kernel"


def tree(root: Path) -> Path:
    """kernel/kernel.cc including a header beside it, one in a subfolder (which includes one two levels up) and a
    shared one a level up, as the real kernels do; returns the .cc."""
    files = {
        "kernel/kernel.cc": (
            '#include <cstdint>\n#include "../shared.h"\n#include "sub/job.h"\n#include "beside.h"\n'
            '// #include "not_included.h"\nextern "C" int32_t Answer() { return Job() + Shared() + Beside(); }\n'
        ),
        "kernel/beside.h": "#pragma once\ninline int Beside() { return 1; }\n",
        "kernel/sub/job.h": '#pragma once\n#include "../../deep/util.h"\ninline int Job() { return Util() + 10; }\n',
        "deep/util.h": "#pragma once\ninline int Util() { return 100; }\n",
        "shared.h": '#pragma once\n#include "kernel/beside.h"\ninline int Shared() { return 1000; }\n',
        "kernel/not_included.h": "#error never compiled\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "kernel" / "kernel.cc"


def test_sources_are_every_quoted_include_transitively(tmp_path):
    source = tree(tmp_path)
    names = [p.relative_to(tmp_path).as_posix() for p in cpu_ffi.sources(source) if tmp_path in p.parents]
    # breadth first, each once (shared.h's include of kernel/beside.h is the same file), none commented out
    assert names == ["kernel/kernel.cc", "shared.h", "kernel/sub/job.h", "kernel/beside.h", "deep/util.h"]


def test_the_kernels_keys_cover_every_header_of_pallas_kernels():
    root = Path(cpu_ffi.__file__).parent
    keyed = {p for source in (stacked_matmul.SOURCE, attention_cpu.SOURCE) for p in cpu_ffi.sources(source)}
    headers = {p.resolve() for p in root.rglob("*.h")}
    assert headers <= keyed, f"headers no kernel's build key covers: {sorted(headers - keyed)}"
    matmul = {p.name for p in cpu_ffi.sources(stacked_matmul.SOURCE)}
    assert {"float_panels.h", "quant_panels.h", "cpu_simd.h", "cpu_team.h", "ffi.h"} <= matmul
    assert {"attend.h", "cpu_simd.h", "cpu_team.h", "ffi.h"} <= {p.name for p in cpu_ffi.sources(attention_cpu.SOURCE)}


def test_a_header_change_anywhere_rebuilds(tmp_path, monkeypatch, caplog):
    """A real compiler run per build (a tiny source: a fraction of a second each)."""
    if not cpu_ffi.find_compiler():
        pytest.skip("no C++ compiler")
    source = tree(tmp_path / "src")
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger=cpu_ffi.__name__)

    def builds() -> int:
        return sum(BUILDING in r.getMessage() for r in caplog.records)

    first = cpu_ffi.build(source)
    assert first.exists() and builds() == 1
    assert cpu_ffi.build(source) == first and builds() == 1  # unchanged: the cached library
    libs = [first]
    for header in ("kernel/sub/job.h", "deep/util.h", "shared.h"):  # a subfolder's, two levels down, a level up
        path = tmp_path / "src" / header
        path.write_text(path.read_text().replace("inline int", "inline int /* changed */"))
        libs.append(cpu_ffi.build(source))
        assert libs[-1] not in libs[:-1] and libs[-1].exists() and builds() == len(libs), header
    (tmp_path / "src" / "kernel" / "not_included.h").write_text("#error changed, still never compiled\n")
    assert cpu_ffi.build(source) == libs[-1] and builds() == len(libs)


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """cpu_ffi's compiler run replaced by a 0.3 s sleep that writes the library (or fails for `fail.cc`), with each
    run's (source name, start, end) recorded."""
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_ffi, "find_compiler", lambda: "c++")
    monkeypatch.setattr(cpu_ffi, "_builds", {})
    runs: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def compile_(compiler, source, lib):
        start = time.perf_counter()
        time.sleep(0.3)
        with lock:
            runs.append((source.name, start, time.perf_counter()))
        if source.name == "fail.cc":
            raise RuntimeError("does not compile")
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"")

    monkeypatch.setattr(cpu_ffi, "_compile", compile_)
    return runs


def test_prebuild_runs_the_compilers_side_by_side_once_each(tmp_path, fake_compiler):
    sources = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        sources.append(tmp_path / name / "kernel.cc")
        sources[-1].write_text(f"// kernel {name}\n")
    cpu_ffi.prebuild(*sources)
    libs = [cpu_ffi.build(s) for s in sources]  # waits for the runs under way, starts none
    assert all(lib.exists() for lib in libs) and len(fake_compiler) == 2
    (_, start_a, end_a), (_, start_b, end_b) = fake_compiler
    assert max(start_a, start_b) < min(end_a, end_b), "the two compiler runs did not overlap"
    assert [cpu_ffi.build(s) for s in sources] == libs and len(fake_compiler) == 2  # built: nothing to do


def test_a_failed_prebuild_is_reported_by_build_without_a_second_run(tmp_path, fake_compiler):
    source = tmp_path / "fail.cc"
    source.write_text("// does not compile\n")
    cpu_ffi.prebuild(source)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="does not compile"):
            cpu_ffi.build(source)
    assert len(fake_compiler) == 1


def test_prebuild_leaves_a_registered_source_be(tmp_path, fake_compiler, monkeypatch):
    """`register` builds once per process: a source it was called for is never built again by `prebuild` (in a
    later cache directory, say), since nothing would wait for that run."""
    source = tmp_path / "kernel.cc"
    source.write_text("// registered\n")
    monkeypatch.setattr(cpu_ffi, "_registered", {source})
    cpu_ffi.prebuild(source)
    time.sleep(0.5)
    assert fake_compiler == []


def test_isa_peak_reports_this_cpus_instruction_rates(tmp_path):
    """benchmarks/isa_peak.cc through machine_ceilings.py's `isa_peak` on one thread, and compiled for the x86-64
    targets this CPU would not pick (AVX2, SSE: no int8 dot there)."""
    import importlib.util
    import platform
    import subprocess

    if not (compiler := cpu_ffi.find_compiler()):
        pytest.skip("no C++ compiler")
    benchmarks = Path(__file__).parents[2] / "benchmarks"
    spec = importlib.util.spec_from_file_location("machine_ceilings", benchmarks / "machine_ceilings.py")
    machine_ceilings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(machine_ceilings)
    peaks = machine_ceilings.isa_peak(threads=1)
    assert peaks["isa_threads"] == 1 and peaks["isa_fma_float32_gflops"] > 0
    if cpu_ffi.isa().startswith("AVX") or "+dotprod" in cpu_ffi.isa():  # isa_peak.cc's HAS_DOT
        assert peaks["isa_int8_dot_gops"] > 0 and peaks["isa_int8_tile_gops"] > 0
    if platform.machine() == "x86_64":
        for march in ("x86-64-v3", "x86-64-v2"):
            obj = tmp_path / f"{march}.o"
            command = [compiler, "-O2", f"-march={march}", "-c", str(benchmarks / "isa_peak.cc"), "-o", str(obj)]
            subprocess.run(command, check=True)

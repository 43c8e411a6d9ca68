"""The CPU kernel self-check: what it decides from its timings, that it is stored and reused, the
JAXLLM_CPU_KERNELS overrides, a kernel that cannot be built, and the step model that follows the choice.

The test suite runs with JAXLLM_CPU_KERNELS=on (conftest.py: the kernels' paths, whatever the
machine's timings say); these tests set the mode they are about.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pallas_kernels import cpu_choice
from pallas_kernels.stacked_matmul import quantized

SHAPES = ((64, 96), (96, 64))
ATTENTION = cpu_choice.AttentionShape(q_heads=4, kv_heads=2, head_dim=32, block_size=16, kv_dtype="float32")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache (so no stored decision) and no decision remembered by this process."""
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    cpu_choice._choose.cache_clear()
    yield tmp_path
    cpu_choice._choose.cache_clear()


def timed(monkeypatch, matmul: dict, attention: dict):
    """Fixed timings instead of measured ones: {rows: (kernel ms, XLA ms)}, {case: (kernel ms, reference ms)}."""
    monkeypatch.setattr(
        cpu_choice, "_time_matmuls", lambda shapes, dtype, rows, rng, bar=None, int8=False: {r: matmul[r] for r in rows}
    )
    monkeypatch.setattr(cpu_choice, "_time_attention", lambda shape, chunk, rng, bar=None: attention)


def untimed(monkeypatch):
    def fail(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(cpu_choice, "_time_matmuls", fail)
    monkeypatch.setattr(cpu_choice, "_time_attention", fail)


def test_auto_keeps_the_kernel_up_to_the_first_row_count_it_loses_and_stores_the_decision(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    timed(
        monkeypatch,
        {1: (1, 2), 8: (1, 2), 64: (3, 2), 128: (1, 2), 256: (1, 2), 512: (1, 2)},
        {"decode": (1, 3), "prefill": (2, 1)},
    )
    choice = cpu_choice.choose(SHAPES, "float32", 512, ATTENTION)
    assert (choice.matmul, choice.matmul_max_rows, choice.attention) == (True, 8, True)  # attention: 3 ms vs 4
    assert "matmul on for rows <= 8, attention on" in choice.describe()
    assert list(fresh.rglob("choices/*.json")), "the decision is stored beside the kernels"
    cpu_choice._choose.cache_clear()  # as a new process would
    untimed(monkeypatch)
    assert cpu_choice.choose(SHAPES, "float32", 512, ATTENTION) == choice
    with pytest.raises(AssertionError, match="timed again"):  # other shapes: a decision of their own
        cpu_choice.choose(SHAPES[:1], "float32", 512, ATTENTION)


def test_auto_turns_off_kernels_that_lose_everywhere(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    timed(monkeypatch, {1: (2, 1), 8: (2, 1), 64: (2, 1)}, {"decode": (3, 1), "prefill": (3, 1)})
    choice = cpu_choice.choose(SHAPES, "float32", 64, ATTENTION)
    assert (choice.matmul, choice.attention) == (False, False)
    assert "matmul off, attention off" in choice.describe()


def test_auto_keeps_a_kernel_that_wins_everywhere_for_every_row_count(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    timed(monkeypatch, {1: (1, 2), 8: (1, 2), 64: (1, 2)}, {"decode": (1, 3), "prefill": (1, 3)})
    choice = cpu_choice.choose(SHAPES, "float32", 64, ATTENTION)
    assert (choice.matmul, choice.matmul_max_rows, choice.attention) == (True, None, True)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_on_and_off_override_without_timing(monkeypatch, fresh, mode):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", mode)
    untimed(monkeypatch)
    choice = cpu_choice.choose(SHAPES, "float32", 64, ATTENTION)
    assert (choice.matmul, choice.matmul_max_rows, choice.attention) == (mode == "on", None, mode == "on")


def test_a_bad_mode_is_a_clear_error(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="JAXLLM_CPU_KERNELS must be one of"):
        cpu_choice.choose(SHAPES, "float32", 64, ATTENTION)


def test_the_real_self_check_takes_seconds(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    started = time.perf_counter()
    choice = cpu_choice.choose(SHAPES, "float32", 64, ATTENTION)
    assert time.perf_counter() - started < 30
    assert set(choice.timings_ms["matmul"]) == {"1", "8", "64"} and set(choice.timings_ms["attention"]) == {
        "decode",
        "prefill",
    }
    assert all(ms > 0 for pair in choice.timings_ms["matmul"].values() for ms in pair)


def test_a_kernel_that_cannot_be_built_falls_back_to_xla_with_one_warning(tmp_path):
    code = (
        "from pallas_kernels import cpu_choice, stacked_matmul\n"
        "from pallas_kernels.ragged_paged_attention import cpu\n"
        f"c = cpu_choice.choose({SHAPES!r}, 'float32', 64, cpu_choice.{ATTENTION!r})\n"
        "print(stacked_matmul.available(), cpu.available(), c.matmul, c.attention)\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "JAXLLM_CACHE": str(tmp_path), "JAXLLM_CPU_KERNELS": "auto"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "False", "False"]
    warnings = [line for line in done.stderr.splitlines() if "unavailable" in line]
    assert len(warnings) == 2, done.stderr  # one per kernel library, each once


def test_xla_only_gives_the_same_greedy_tokens_as_the_kernels(monkeypatch, llm):
    """`JAXLLM_CPU_KERNELS=off` (XLA's dot and the jnp attention) against the session's engine ("on")."""
    from jaxllm import LLM, SamplingParams
    from tests.conftest import TEST_ENGINE, kv_bytes

    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "off")
    xla_only = LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(64))
    model = xla_only.engine.runner.model
    assert (model.matmul_backend, model.attention_backend) == ("reference", "reference")
    assert llm.engine.runner.model.matmul_backend == "cpu_packed"
    prompts = ["The capital of France is", "def fibonacci(n):", "Three colors are"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in xla_only.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_one_kernel_missing_leaves_the_other_to_its_check(monkeypatch, fresh):
    from pallas_kernels.ragged_paged_attention import cpu as attention_cpu

    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    monkeypatch.setattr(attention_cpu, "available", lambda: False)
    timed(monkeypatch, {1: (1, 2), 8: (1, 2), 64: (1, 2)}, {})
    choice = cpu_choice.choose(SHAPES, "float32", 64, ATTENTION)
    assert (choice.matmul, choice.matmul_max_rows, choice.attention) == (True, None, False)


def test_the_self_check_times_quantized_projections_too(monkeypatch, fresh):
    """(K, N, fmt) shapes: random packed quants of the format, the quantized kernel against XLA's dequantize and
    dot on them; a decision of their own (the format joins the key)."""
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    shapes = ((64, 96, "q4_1"), (96, 64, "q8_0"), (64, 64, "int8"), (64, 96))
    choice = cpu_choice.choose(shapes, "float32", 8, None)
    assert set(choice.timings_ms["matmul"]) == {"1", "8"}
    assert all(ms > 0 for pair in choice.timings_ms["matmul"].values() for ms in pair)
    cpu_choice._choose.cache_clear()
    untimed(monkeypatch)
    assert cpu_choice.choose(shapes, "float32", 8, None) == choice  # stored
    with pytest.raises(AssertionError, match="timed again"):
        cpu_choice.choose(((64, 96, "q4_0"), *shapes[1:]), "float32", 8, None)


QUANT_SHAPES = ((64, 96, "q4_1"), (64, 96))


def test_auto_runs_the_integer_path_from_the_rows_where_it_wins_from_there_on(monkeypatch, fresh):
    """(kernel, XLA, kernel's integer path) per row count: the integer path from 64 rows (it lost at 8), and the
    kernel's limit against XLA judged by the path it then takes (the integer one beats XLA at 512, the float one
    would not)."""
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    monkeypatch.setenv("JAXLLM_CPU_INT8_DOT", "auto")
    times = {1: (1, 2), 4: (1, 2, 1.5), 8: (1, 2, 1.5), 64: (2, 3, 1), 128: (2, 3, 1), 256: (4, 5, 2), 512: (6, 5, 3)}
    timed(monkeypatch, times, {"decode": (1, 3), "prefill": (1, 3)})
    choice = cpu_choice.choose(QUANT_SHAPES, "float32", 512, ATTENTION)
    assert (choice.matmul, choice.matmul_max_rows, choice.int8_min_rows) == (True, None, 64)
    assert "matmul on, int8 dot from 64 rows" in choice.describe()


def test_auto_keeps_the_float_path_where_the_integer_one_loses_at_the_most_rows(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    monkeypatch.setenv("JAXLLM_CPU_INT8_DOT", "auto")
    timed(
        monkeypatch, {1: (1, 2), 4: (1, 2, 0.5), 8: (1, 2, 0.5), 64: (1, 2, 1.5)}, {"decode": (1, 3), "prefill": (1, 3)}
    )
    choice = cpu_choice.choose(QUANT_SHAPES, "float32", 64, ATTENTION)
    assert choice.int8_min_rows == 0 and "int8" not in choice.describe()


def test_where_the_few_rows_have_an_integer_path_four_rows_are_timed_too(monkeypatch, fresh):
    """A verification of drafts or a few sequences (the integer path's lead over the float one grows with the rows:
    4 rows of the default model 2.5x, 1 row about even): losing at 1 row no longer sends 2-8 rows to the float
    path."""
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    monkeypatch.setenv("JAXLLM_CPU_INT8_DOT", "auto")
    monkeypatch.setattr(quantized, "int8_few_rows", lambda: True)
    times = {1: (1, 9, 1.1), 4: (2, 9, 1), 8: (3, 9, 1.5), 64: (9, 20, 5)}
    timed(monkeypatch, times, {"decode": (1, 3), "prefill": (1, 3)})
    choice = cpu_choice.choose(QUANT_SHAPES, "float32", 64, ATTENTION)
    assert set(choice.timings_ms["matmul"]) == {"1", "4", "8", "64"} and choice.int8_min_rows == 4


@pytest.mark.parametrize("kernels", ["auto", "on"])
@pytest.mark.parametrize("int8", ["on", "off"])
def test_the_int8_override_needs_no_timing(monkeypatch, fresh, kernels, int8):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", kernels)
    monkeypatch.setenv("JAXLLM_CPU_INT8_DOT", int8)
    timed(monkeypatch, {1: (1, 2), 8: (1, 2), 64: (1, 2)}, {"decode": (1, 3), "prefill": (1, 3)})  # pairs: no int8
    choice = cpu_choice.choose(QUANT_SHAPES, "float32", 64, ATTENTION)
    assert choice.int8_min_rows == (1 if int8 == "on" else 0)
    assert cpu_choice.choose(SHAPES, "float32", 64, ATTENTION).int8_min_rows == 0  # nothing quantized


def test_the_default_is_the_exact_path(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    monkeypatch.delenv("JAXLLM_CPU_INT8_DOT", raising=False)
    timed(monkeypatch, {1: (1, 2), 8: (1, 2), 64: (1, 2)}, {"decode": (1, 3), "prefill": (1, 3)})
    assert cpu_choice.choose(QUANT_SHAPES, "float32", 64, ATTENTION).int8_min_rows == 0


def test_under_kernels_on_int8_auto_is_the_exact_path(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "on")
    monkeypatch.setenv("JAXLLM_CPU_INT8_DOT", "auto")
    untimed(monkeypatch)
    assert cpu_choice.choose(QUANT_SHAPES, "float32", 64, ATTENTION).int8_min_rows == 0


def test_a_bad_int8_mode_is_a_clear_error(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_INT8_DOT", "yes")
    with pytest.raises(ValueError, match="JAXLLM_CPU_INT8_DOT must be one of"):
        cpu_choice.choose(QUANT_SHAPES, "float32", 64, ATTENTION)


def test_the_real_self_check_times_the_integer_path(monkeypatch, fresh):
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")
    monkeypatch.setenv("JAXLLM_CPU_INT8_DOT", "auto")
    choice = cpu_choice.choose(((64, 96, "q4_1"), (96, 64, "q8_0")), "float32", 64, None)
    matmul = choice.timings_ms["matmul"]
    # one row: timed twice where the few-row regime has an integer path (4-bit on AVX512-VBMI, NEON, SSE)
    assert len(matmul["1"]) == (3 if quantized.int8_few_rows() else 2)
    assert len(matmul["8"]) == 3 and len(matmul["64"]) == 3 and ("4" in matmul) == quantized.int8_few_rows()
    assert all(ms > 0 for times in matmul.values() for ms in times)

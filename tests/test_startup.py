"""Start-up: compiled steps reloaded from disk give the same tokens; the executable cache's edges;
the in-house GGUF header reader against the `gguf` package's; the cached GGUF tokenizer against a
fresh conversion; stable KV block counts."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.runner.executable_cache import ExecutableCache, abstract_signature, fingerprint
from jaxllm.runner.kv_cache import _stable
from tests.conftest import TEST_ENGINE, TEST_KV_BLOCKS, kv_bytes


def test_a_second_engine_loads_every_bucket_compiled_and_generates_the_same(llm):
    """The session engine compiled (or loaded) its executables; a second one with its settings loads all of them."""
    second = LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(TEST_KV_BLOCKS))
    runner = second.engine.runner
    # each bucket's forward, and one sampler per distinct row count (buckets with as many rows share it)
    assert runner.num_executables == len(runner.buckets) + len({b.num_seqs for b in runner.buckets})
    assert runner.loaded_executables == runner.num_executables
    # on CPU the loader packs the weights for the matmul kernel, and the converted weights are kept packed
    assert second.engine.loaded.laid_out == (runner.model.matmul_backend == "cpu_packed")
    assert runner.startup_seconds["prepare_weights"] < 0.5  # nothing left to pack
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert ids(second.generate(prompts, params, use_tqdm=False)) == ids(llm.generate(prompts, params, use_tqdm=False))


def test_the_compiled_step_cache_can_be_turned_off_alone(llm, monkeypatch):
    """JAXLLM_DISABLE_EXECUTABLE_CACHE=1: every step traced again (JAX's cache serving its compile), none loaded."""
    monkeypatch.setenv("JAXLLM_DISABLE_EXECUTABLE_CACHE", "1")
    third = LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(TEST_KV_BLOCKS))
    assert third.engine.runner.loaded_executables == 0
    assert third.engine.runner._executables.folder is None  # nothing stored either
    prompts = ["The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert ids(third.generate(prompts, params, use_tqdm=False)) == ids(llm.generate(prompts, params, use_tqdm=False))


def _step(x, state):
    return jnp.tanh(x @ x.T).sum(0) + state, state * 2  # `state` is donated, as the engine's KV cache is


def test_executable_round_trip_keeps_results_and_donation(tmp_path):
    cache = ExecutableCache(tmp_path)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)
    fn = jax.jit(_step, donate_argnums=(1,))
    key = fingerprint("test", abstract_signature((x, x[0])))
    device = jax.devices()[:1]  # the tests run with 4 host devices: an executable loads onto its own
    assert cache.load(key, device) is None
    fresh, compiled_here = cache.compile(fn.lower(x, x[0]))
    assert compiled_here  # (compiled in well under JAX's 0.5 s threshold: never in JAX's cache)
    cache.store(key, fresh)
    expected = jax.device_get(fresh(x, jnp.ones(64)))
    loaded = cache.load(key, device)
    assert loaded is not None
    state = jnp.ones(64)
    got = jax.device_get(loaded(x, state))
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    assert state.is_deleted()  # still donated
    damaged = bytearray(cache._path(key).read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    cache._path(key).write_bytes(bytes(damaged))
    assert cache.load(key, device) is None  # a damaged file is never handed to XLA: compile again


def test_unreadable_executable_means_compile_not_crash(tmp_path, caplog):
    cache = ExecutableCache(tmp_path)
    (tmp_path / "k.bin").write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING):
        assert cache.load("k", jax.devices()[:1]) is None
    assert "unreadable" in caplog.text
    assert ExecutableCache(None).load("k", jax.devices()[:1]) is None  # caching off: always compile


def test_signature_tells_shapes_dtypes_and_trees_apart():
    a = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    signatures = {
        abstract_signature(args)
        for args in [
            (a,),
            (jax.ShapeDtypeStruct((4, 9), jnp.float32),),
            (jax.ShapeDtypeStruct((4, 8), jnp.bfloat16),),
            ((a,),),
            ({"k": a},),
        ]
    }
    assert len(signatures) == 5


def test_gguf_header_matches_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    from jaxllm.weights.default import default_model_path
    from jaxllm.weights.gguf import GGUFFile

    path = default_model_path()
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert len(ours._tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        raw = ours._raw(tensor.name)
        assert raw.dtype == tensor.data.dtype and raw.shape == tensor.data.shape
        np.testing.assert_array_equal(raw, tensor.data)


def test_steps_compiled_from_the_config_alone_fit_the_loaded_weights(default_model):
    """An engine compiles from `ModelSource.abstract_params` while the weights load: the compiled steps are then
    called with the loaded arrays, so both must agree on every shape, dtype and sharding."""
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.weights import open_model

    source = open_model(None, dtype="float32")
    assert source.arch == default_model.arch
    assert abstract_signature(source.abstract_params(make_mesh())) == abstract_signature(default_model.params)
    leaves = jax.tree.leaves(default_model.params)  # aligned host arrays: on CPU, placed without a copy
    assert all(leaf.addressable_shards[0].data.unsafe_buffer_pointer() % 64 == 0 for leaf in leaves)


def test_converted_weights_are_mapped_by_the_next_load_and_reconverted_when_damaged(
    tmp_path, monkeypatch, caplog, default_model
):
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.weights import converted, load_model

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    first = load_model(None, mesh=make_mesh(), dtype="float32")  # converts, and saves in a thread
    converted.wait_for_saves()
    [folder] = (tmp_path / "weights").iterdir()
    mapped = load_model(None, mesh=make_mesh(), dtype="float32")
    for fresh, saved, reference in zip(
        *map(jax.tree.leaves, (first.params, mapped.params, default_model.params)), strict=True
    ):
        assert saved.dtype == reference.dtype and saved.sharding == reference.sharding
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(reference))
        np.testing.assert_array_equal(np.asarray(fresh), np.asarray(reference))
    (folder / "norm.weight.npy").write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING):
        again = load_model(None, mesh=make_mesh(), dtype="float32")
    assert "converting again" in caplog.text
    np.testing.assert_array_equal(
        np.asarray(again.params["norm"]["weight"]), np.asarray(default_model.params["norm"]["weight"])
    )


def test_a_full_disk_costs_only_the_kept_conversion(tmp_path, monkeypatch, caplog, default_model):
    """Converting into the kept files: when the disk cannot take one, the rest is converted in memory, the
    weights are the same, and no half-written folder is left behind."""
    import errno
    import os

    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.weights import converted, load_model

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    reserved = []

    def fallocate(fd, offset, length):
        if reserved:  # the first leaf's file fits, the second does not
            raise OSError(errno.ENOSPC, "No space left on device")
        reserved.append(length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with caplog.at_level(logging.WARNING):
        loaded = load_model(None, mesh=make_mesh(), dtype="float32")
    converted.wait_for_saves()
    assert "could not keep the converted weights" in caplog.text and reserved
    assert not any((tmp_path / "weights").iterdir())
    for leaf, reference in zip(*map(jax.tree.leaves, (loaded.params, default_model.params)), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(reference))


def test_kv_block_counts_from_free_memory_are_stable():
    assert [_stable(n) for n in (1, 15, 16, 17, 33, 2911, 2900)] == [1, 15, 16, 16, 32, 2816, 2816]
    assert all(_stable(n) > n * 7 / 8 for n in range(1, 5000))


def test_cached_gguf_tokenizer_is_the_converted_one(tmp_path, monkeypatch):
    from jaxllm.weights.default import default_model_path
    from jaxllm.weights.gguf import GGUFFile

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
    gguf_file = GGUFFile(default_model_path())
    converted = gguf_file.tokenizer()
    assert gguf_file._tokenizer_cache_path().is_file()
    cached = gguf_file.tokenizer()
    chat = [{"role": "user", "content": "Hi <|im_end|> there"}]
    for text in ["Hello, world!", "  spaces\tand\nnewlines ", "naïve café 日本語 🙂", "<|im_start|>user"]:
        assert cached.encode(text) == converted.encode(text)
    assert cached.apply_chat_template(chat, tokenize=False) == converted.apply_chat_template(chat, tokenize=False)
    assert (cached.bos_token, cached.eos_token, cached.pad_token) == (
        converted.bos_token,
        converted.eos_token,
        converted.pad_token,
    )
    assert cached.get_vocab() == converted.get_vocab()


def test_a_cold_start_reports_every_slow_step(tmp_path, monkeypatch, caplog, capsys):
    """Issue 44: a first start said nothing for ~20 s. Each first-use step logs a line when it starts and, with the
    engine's progress on, draws a bar: a kernel build (a small source here: the real ones take ~7 s each), the
    kernels' self-check, the GGUF weights' and tokenizer's conversion, compiling; with progress off, no bar."""
    from jaxllm.weights import converted
    from jaxllm.weights.default import cache_dir
    from pallas_kernels import cpu_choice, cpu_ffi, progress, stacked_matmul
    from pallas_kernels.ragged_paged_attention import cpu as attention_cpu

    kernels = [cpu_ffi.build(s) for s in (stacked_matmul.SOURCE, attention_cpu.SOURCE)]  # this session's, built
    compiled = str(cache_dir() / "xla")  # the session's compiled steps: load them, as the tests do
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))  # an empty cache but for the kernels (a build is below)
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "auto")  # the self-check, not the tests' "on"
    (tmp_path / "kernels").mkdir()
    for lib in kernels:
        (tmp_path / "kernels" / lib.name).symlink_to(lib)
    cpu_choice._choose.cache_clear()
    caplog.set_level(logging.INFO)

    source = tmp_path / "tiny_kernel.cc"
    source.write_text('extern "C" int tiny() { return 0; }\n')
    cpu_ffi.build(source)
    LLM(
        **{**TEST_ENGINE, "progress": True},
        kv_cache_memory_bytes=kv_bytes(TEST_KV_BLOCKS),
        compilation_cache_dir=compiled,
    )
    converted.wait_for_saves()
    logged = caplog.text
    for started in (
        "building the CPU kernel",
        "checking the CPU kernels against XLA",
        "converting SmolLM2-135M-Instruct.Q4_1.gguf into",
        "converting the tokenizer of SmolLM2-135M-Instruct.Q4_1.gguf",
    ):
        assert started in logged
    bars = capsys.readouterr().err
    cases = len([1, 8, 64]) + 2  # row counts up to max_num_batched_tokens, a decode and a prefill attention
    assert f"CPU kernel self-check: 100%|██████████| {cases}/{cases}" in bars
    assert "Converting weights: 100%" in bars and "Compiling steps: 100%" in bars

    # progress off (LLM(progress=False), the tests): the same steps draw nothing
    shapes = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    shardings = {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    with progress.showing(False):
        converted.load_or_convert(
            gguf,
            "tiny",
            np.float32,
            shapes,
            shardings,
            "",
            lambda allocate: {"w": allocate(("w",), (4, 4), np.dtype(np.float32))},
        )
    converted.wait_for_saves()
    assert "Converting weights" not in capsys.readouterr().err

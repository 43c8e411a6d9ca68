"""What an engine start checks and reports around the model: the compilation cache, the model's split over the
devices, a prompt's limits, and the one line that says the engine is ready (and what it holds)."""

from __future__ import annotations

import logging
import os

import jax

from jaxllm.model.registry import ModelArch
from jaxllm.parallel.pipeline import layer_ranges
from jaxllm.weights.default import cache_dir

logger = logging.getLogger("jaxllm")


def enable_compilation_cache(folder: str | None) -> str | None:
    """JAX's persistent compilation cache, on by default in jaxllm's cache folder ("" turns it off)."""
    if folder == "":
        return None
    folder = folder or os.path.join(cache_dir(), "xla")
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return folder


def check_layout(arch: ModelArch, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Raise ValueError unless the model splits over the devices as asked (before any weight loads)."""
    if arch.num_kv_heads % tensor_parallel_size:  # the cache is sharded over KV heads
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the model's {arch.num_kv_heads} KV heads"
        )
    layer_ranges(arch.num_layers, pipeline_parallel_size)  # checks that every stage gets layers


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError unless the prompt is 1..max_model_len token ids in [0, vocab_size)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if n > max_model_len:
        raise ValueError(f"the prompt has {n} tokens, more than max_model_len={max_model_len}")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")


def log_ready(core, cache_folder: str | None) -> None:
    """The start-up line: the model, its KV cache and limits, the compiled steps, and how long each part took."""
    sched, arch = core.config.scheduler, core.loaded.arch
    block_size = core.config.cache.block_size
    capacity = core.kv.num_usable_blocks * block_size
    logger.info(
        "model %s (%s, %s; quantized: %s) loaded in %.1fs; KV cache %d blocks x %d = %d tokens%s; max_model_len %d, "
        "max_num_seqs %d, max_num_batched_tokens %d%s; %d buckets (%d executables) ready in %.1fs (%d loaded "
        "compiled; cache: %s); "
        "ready in %.1fs",
        core.loaded.name,
        arch.architecture,
        core.loaded.dtype.name,
        core.loaded.quant.describe(),
        sum(core.loaded.load_seconds.values()),
        core.kv.num_usable_blocks,
        block_size,
        capacity,
        f" in {groups}" if (groups := core.runner.kv_groups.describe()) else "",
        sched.max_model_len,
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        f"; reasoning parser {core.reasoning.name}" if core.reasoning is not None else "",
        len(core.runner.buckets),
        core.runner.num_executables,
        core.runner.compile_seconds,
        core.runner.loaded_executables,
        cache_folder or "off",
        core.startup_seconds,
    )

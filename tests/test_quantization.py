"""Quantized weights (`quantization`): the plan, the loaders, and the model's outputs against float32.

Kernels are checked in tests/kernels/test_quantized_matmul.py and perplexity in tests/test_perplexity.py.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxllm.model import CausalLM, KVCache
from jaxllm.model.registry import arch_from_hf_config
from jaxllm.parallel.mesh import make_mesh
from jaxllm.weights import load_model
from jaxllm.weights.quant.plan import make_plan
from pallas_kernels.stacked_matmul import quantized
from tests.conftest import TEST_ENGINE, kv_bytes
from tests.paged_batch import make_step
from tests.tiny_models import PANEL_LLAMA, random_model

QUANT_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model = random_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**PANEL_LLAMA))
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


def modules(params):
    """(name, node) of each projection: the stacked layers' and the embedding."""
    layers = params["layers"]
    yield "qkv_proj", layers["self_attn"]["qkv_proj"]
    yield "o_proj", layers["self_attn"]["o_proj"]
    yield "gate_up_proj", layers["mlp"]["gate_up_proj"]
    yield "down_proj", layers["mlp"]["down_proj"]
    yield "embed_tokens", params["embed_tokens"]


def as_weight(node, stacked: bool) -> quantized.QuantizedWeight:
    qw = quantized.QuantizedWeight(node["qweight"], node["scales"], node.get("mins"))
    return qw if stacked else quantized.QuantizedWeight(*(None if a is None else a[None] for a in qw))


def float_kernel(node, stacked: bool) -> np.ndarray:
    """The float weight as `[L, K, *N]` (an embedding `[V, H]` as its `[1, H, V]` transpose)."""
    return np.asarray(node["kernel"]) if stacked else np.asarray(node["embedding"]).T[None]


def dequantized(qw, layer) -> np.ndarray:
    return np.asarray(jax.jit(quantized.dequantize, static_argnames="packed")(qw, layer, packed=False))


# --- the plan ---------------------------------------------------------------------------------------------------


def test_the_default_gguf_keeps_its_own_formats_and_int8_int4_none_say_what_they_keep(default_model):
    arch = default_model.arch
    assert dict(default_model.quant.formats) == {**dict.fromkeys(QUANT_MODULES, "q4_1"), "embed_tokens": "q8_0"}
    assert dict(make_plan(arch, "int8", None).formats) == dict.fromkeys((*QUANT_MODULES, "embed_tokens"), "int8")
    int4 = {**dict.fromkeys(QUANT_MODULES, "int4"), "embed_tokens": "int8"}
    assert dict(make_plan(arch, "int4", None).formats) == int4
    assert not make_plan(arch, "none", {"blk.0.attn_q.weight": "Q4_1"})
    assert not make_plan(arch, None, None)  # a float format stays float


def test_a_quantization_the_model_cannot_take_fails_naming_the_tensor_and_the_rule(caplog):
    arch = arch_from_hf_config({**PANEL_LLAMA, "architectures": ["LlamaForCausalLM"], "intermediate_size": 48})
    with pytest.raises(ValueError, match="down_proj has 48 inputs, not a multiple of the group size 32"):
        make_plan(arch, "int4", None)
    make_plan(arch, "int8", None)  # per channel: any size
    wide = arch_from_hf_config({**PANEL_LLAMA, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=4 splits down_proj's 128 inputs into shards of 32|"
        "tensor_parallel_size=4 splits o_proj's 64 inputs into shards of 16",
    ):
        make_plan(wide, "int4", None, tp=4)
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_plan(wide, "fp8", None)
    blocks = {f"blk.{i}.{p}.weight": "Q4_1" for i in range(2) for p in ("attn_output", "ffn_down", "ffn_up")}
    with caplog.at_level(logging.INFO):  # not asked for: a GGUF's blocks TP cannot split stay float, said so
        plan = make_plan(wide, None, blocks, tp=4)
    assert plan.get("o_proj") is None and "o_proj dequantized to float: the GGUF's Q4_1 blocks" in caplog.text
    names = {f"blk.{i}.{p}.weight": "Q4_1" for i in range(2) for p in ("attn_q", "attn_k", "attn_v")}
    names["blk.1.attn_v.weight"] = "Q6_K"
    with caplog.at_level(logging.INFO):
        plan = make_plan(wide, None, {**names, "token_embd.weight": "Q8_0"})
    assert plan.get("qkv_proj") is None and plan.get("embed_tokens") == "q8_0"
    assert "qkv_proj" in caplog.text and "mixed types Q4_1/Q6_K" in caplog.text


def test_an_unknown_quantization_is_refused_before_anything_loads():
    from jaxllm import LLM

    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="q3", progress=False)


# --- loading ----------------------------------------------------------------------------------------------------


def test_gguf_blocks_are_kept_in_their_bits(default_model):
    """The default model's Q4_1 layers and Q8_0 embedding, loaded as they are, dequantize to exactly the float32
    weights the dequantizing loader makes (the gguf package's formulas)."""
    dequantized_model = load_model(None, mesh=make_mesh(), dtype="float32", quantization="none")
    ours, floats = dict(modules(default_model.params)), dict(modules(dequantized_model.params))
    for name, node in ours.items():
        stacked = name != "embed_tokens"
        qw = as_weight(node, stacked)
        assert node["qweight"].dtype == (jnp.uint8 if stacked else jnp.int8)  # 4 bits a weight, or 8
        reference = float_kernel(floats[name], stacked)
        for layer in (0, len(reference) - 1):
            got = dequantized(qw, layer).reshape(reference[layer].shape)
            np.testing.assert_array_equal(got, reference[layer], err_msg=f"{name} layer {layer}")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_at_load_every_weight_is_within_half_a_step(tiny_dir, fmt):
    """Rounding moves a weight by at most half a step d, plus (int4) what rounding the group's minimum to float16
    moved it (at most 2^-11 of it)."""
    floats = dict(modules(load_model(str(tiny_dir), mesh=make_mesh(), quantization="none").params))
    quants = dict(modules(load_model(str(tiny_dir), mesh=make_mesh(), quantization=fmt).params))
    for name, node in quants.items():
        stacked = name != "embed_tokens"
        qw, reference = as_weight(node, stacked), float_kernel(floats[name], stacked)
        group = quantized.FORMATS[fmt if stacked else "int8"].group or reference.shape[1]
        for layer in range(len(reference)):
            w = reference[layer].reshape(reference.shape[1], -1)
            got = dequantized(qw, layer).reshape(w.shape)
            step = np.abs(np.asarray(node["scales"][layer] if stacked else node["scales"]).astype(np.float32))
            step = np.repeat(step.reshape(-1, w.shape[1]), group, axis=0)
            bound = step / 2 * 1.001 + 1e-7
            if "mins" in node:
                bound += np.repeat(np.abs(np.asarray(node["mins"][layer])).reshape(-1, w.shape[1]), group, 0) / 2048
            assert np.all(np.abs(got - w) <= bound), f"{name} layer {layer}"


def test_a_float_checkpoint_is_quantized_at_load_as_the_source_is(tiny_dir, tmp_path):
    """`jaxllm convert` keeps float weights; loading the checkpoint with int4 quantizes them as loading the source
    with int4 does."""
    from jaxllm.entrypoints.convert import convert

    checkpoint = convert(str(tiny_dir), str(tmp_path / "ckpt"), dtype="float32")
    ours = load_model(str(checkpoint), mesh=make_mesh(), quantization="int4")
    reference = load_model(str(tiny_dir), mesh=make_mesh(), quantization="int4")
    assert ours.quant == reference.quant
    flat = jax.tree_util.tree_flatten_with_path(ours.params)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


# --- the model --------------------------------------------------------------------------------------------------


def tiny_logits(loaded, *, packed: bool, mesh_size: int = 1) -> np.ndarray:
    """Logits of every position of three ragged prompts in one step."""
    arch = loaded.arch
    model = CausalLM(
        arch, jnp.float32, "reference", matmul_backend="cpu_packed" if packed else "reference", quant=loaded.quant
    )
    params = model.pack(loaded.params) if packed else loaded.params
    shape = (arch.num_layers, 1 + 3 * 2, 16, arch.num_kv_heads, arch.head_dim)
    cache = KVCache(jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))
    rng = np.random.default_rng(1)
    seqs = [[int(t) for t in rng.integers(0, arch.vocab_size, n)] for n in (5, 17, 9)]
    batch = make_step([(s, 0, len(s), [1 + 2 * i, 2 + 2 * i]) for i, s in enumerate(seqs)], 16, 2)
    batch = batch._replace(logits_indices=jnp.arange(len(batch.token_ids), dtype=jnp.int32))
    logits, _ = jax.jit(model.apply)({"params": params}, cache, batch)
    return np.asarray(logits)


@pytest.mark.parametrize("fmt, bound", [("int8", 0.02), ("int4", 0.15)])
def test_int8_and_int4_logits_stay_close_to_float32(tiny_dir, fmt, bound):
    """The bound comes from the quantization step. Rounding moves a weight by a uniform error of RMS step / sqrt(12);
    the step is max|w| / 127 per channel (int8: ~2.7 sigma over 64-128 inputs, so 0.6 % of the weights' RMS) or
    (max - min) / 15 per group of 32 (int4: ~4.2 sigma / 15, 8 %). A matmul's output moves by the same fraction,
    and the fractions of the model's matmuls add as a square root, damped by the norms: measured about 1 % (int8)
    and 7 % (int4) relative RMS error of the logits; the bounds are about three and two times one matmul's."""
    reference = tiny_logits(load_model(str(tiny_dir), mesh=make_mesh(), quantization="none"), packed=False)
    loaded = load_model(str(tiny_dir), mesh=make_mesh(), quantization=fmt)
    for packed in (False, True):
        got = tiny_logits(loaded, packed=packed)
        error = np.sqrt(np.mean((got - reference) ** 2) / np.mean(reference**2))
        assert error < bound, f"{fmt} packed={packed}: relative RMS error {error:.3f}"
        assert (got.argmax(-1) == reference.argmax(-1)).mean() > 0.8


def test_quantized_weights_shard_over_tensor_parallel_devices(tiny_dir):
    """int4 with two shards: the scales and quants split along the same axis (groups whole) and give the logits of
    one device."""
    one = tiny_logits(load_model(str(tiny_dir), mesh=make_mesh(), quantization="int4"), packed=False)
    two = load_model(str(tiny_dir), mesh=make_mesh(2), quantization="int4")
    down = two.params["layers"]["mlp"]["down_proj"]
    assert down["qweight"].sharding.spec == down["scales"].sharding.spec  # row-parallel: both along K
    np.testing.assert_allclose(tiny_logits(two, packed=False), one, rtol=1e-4, atol=1e-4)


# --- the engine -------------------------------------------------------------------------------------------------


def test_the_default_model_in_its_q4_1_blocks_decodes_as_its_float32_form(llm):
    """Same values, another summation order: the same greedy tokens as the dequantized float32 model."""
    from jaxllm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert llm.engine.loaded.quant.get("qkv_proj") == "q4_1"
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    floats = LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(64), quantization="none")
    assert [o.outputs[0].token_ids for o in floats.generate(prompts, params, use_tqdm=False)] == native

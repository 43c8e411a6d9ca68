"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) end to end, against transformers on the same weights.

Tiny random models built from transformers' own config classes and saved with `save_pretrained` (each expert's
tensors, as checkpoints on the Hub are; Qwen3-MoE also in transformers 5's fused form) run through a whole engine:
twelve prompts, 32 greedy tokens each, four sequences at a time and 16-token steps, so prompts prefill in chunks
beside other sequences' decodes. Routing and the grouped expert matmul are checked alone against a float64 oracle
(every token to one expert, an expert with no tokens, tied router scores).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxllm import LLM, SamplingParams
from jaxllm.model.grouped import KernelExperts, tile_rows
from jaxllm.model.moe import grouped_swiglu, pack_experts, route
from jaxllm.runner.compilations import compilation_count
from pallas_kernels.stacked_matmul.quantized import QuantizedWeight, random_weight
from pallas_kernels.stacked_matmul.quantized import _dequant_numpy as dequant
from tests.gguf_models import write_gguf
from tests.hf_reference import hf_greedy, hf_log_softmax
from tests.tiny_models import CHUNKED_ENGINE, MOE_CASES, TINY_DECODER, random_model

TINY, ENGINE, ARCHITECTURES = TINY_DECODER, CHUNKED_ENGINE, MOE_CASES
rng = np.random.default_rng(7)
PROMPTS = [rng.integers(0, TINY["vocab_size"], int(n)).tolist() for n in rng.integers(3, 40, 12)]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def tiny_model(name: str, **overrides):
    config_cls, model_cls, moe = ARCHITECTURES[name]
    config = getattr(transformers, config_cls)(**{**TINY, **moe, **overrides})
    config.architectures = [model_cls]
    return random_model(getattr(transformers, model_cls), config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """architecture → (its transformers model, the directory save_pretrained wrote)."""
    root = tmp_path_factory.mktemp("moe")
    models = {}
    for name in ARCHITECTURES:
        model = tiny_model(name)
        model.save_pretrained(root / name)
        models[name] = (model, str(root / name))
    return models


def generate(model_dir: str, **engine) -> list[list[int]]:
    llm = LLM(model_dir, **{**ENGINE, **engine})
    before = compilation_count()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert compilation_count() == before, "a step compiled after warm-up"
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_tokens_equal_transformers_with_chunked_prefill(saved, name):
    model, model_dir = saved[name]
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
    assert generate(model_dir) == want


def test_fused_expert_checkpoints_load_as_per_expert_ones(saved, tmp_path):
    """transformers 5 keeps experts fused (`experts.gate_up_proj`): such a checkpoint gives the same tokens."""
    model, model_dir = saved["qwen3_moe"]
    model.save_pretrained(tmp_path, save_original_format=False)
    assert generate(str(tmp_path)) == generate(model_dir)


@pytest.mark.parametrize(
    "name,expert_type", [("mixtral", "Q4_1"), ("qwen2_moe", "Q8_0"), ("qwen3_moe", "Q4_1"), ("olmoe", "Q8_0")]
)
def test_gguf_experts_stay_in_their_bits_and_equal_the_dequantized_model(saved, tmp_path, name, expert_type):
    """The tiny models as GGUF files with llama.cpp's names (`ffn_*_exps`, its metadata, Mixtral as "llama"),
    experts in Q8_0 or Q4_1: loaded in their bits, the tokens those transformers gives with the experts dequantized."""
    model, _ = saved[name]
    path = tmp_path / f"{name}.gguf"
    reference = write_gguf(model, path, expert_type)
    llm = LLM(str(path), **ENGINE)
    params = llm.engine.runner.params
    experts = params["layers"]["mlp"]["experts_gate_up"]
    assert experts["qweight"].dtype == (jnp.int8 if expert_type == "Q8_0" else jnp.uint8)
    before = compilation_count()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert compilation_count() == before
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        hf_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS
    ]


def test_gguf_moe_metadata_and_expert_tensors(saved, tmp_path):
    """A GGUF's MoE config as transformers reads the model's, and a layer's experts (two GGUF tensors joined as
    transformers fuses them) as the dequantized values, in float and in their bits."""
    from jaxllm.weights.gguf import GGUFFile
    from jaxllm.weights.quant.gguf_blocks import dequantize

    model, _ = saved["qwen2_moe"]
    reference = write_gguf(model, tmp_path / "m.gguf", "Q8_0")
    f = GGUFFile(tmp_path / "m.gguf")
    config = f.hf_config()
    assert config["architectures"] == ["Qwen2MoeForCausalLM"] and config["num_experts"] == 8
    assert (config["num_experts_per_tok"], config["moe_intermediate_size"], config["norm_topk_prob"]) == (2, 32, False)
    assert config["shared_expert_intermediate_size"] == 64 and config["mlp_only_layers"] == []
    want = reference.state_dict()["model.layers.1.mlp.experts.gate_up_proj"].numpy()
    np.testing.assert_array_equal(f.tensor("model.layers.1.mlp.experts.gate_up_proj"), want)
    blocks = f.blocks("model.layers.1.mlp.experts.gate_up_proj")
    np.testing.assert_array_equal(dequantize(blocks).reshape(want.shape), want)
    assert f.tokenizer() is None  # (no tokenizer in the file: token-id prompts only, as an HF folder without one)


def test_gguf_k_quant_experts_are_requantized_never_expanded(caplog):
    """Experts in a type jaxllm does not keep (K-quants) are re-quantized at load, with a log line: int4 from 4
    bits and fewer, int8 where any layer has more; attention in such types is dequantized as for dense models."""
    from jaxllm.model.registry import arch_from_hf_config
    from jaxllm.weights.quant.plan import make_plan

    config = {**TINY, **ARCHITECTURES["qwen3_moe"][2], "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16}
    arch = arch_from_hf_config(config)

    def types(experts):
        names = ["token_embd.weight", "output.weight"]
        attention = [f"blk.{i}.attn_{p}.weight" for i in range(2) for p in ("q", "k", "v", "output")]
        ffn = [f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")]
        return {**dict.fromkeys(names, "F32"), **dict.fromkeys(attention, "Q4_K"), **dict.fromkeys(ffn, experts)}

    with caplog.at_level("INFO"):
        plan = dict(make_plan(arch, "auto", types("Q4_K")).formats)
    assert plan == {"experts_gate_up": "int4", "experts_down": "int4"}
    assert "re-quantized to int4" in caplog.text
    mixed = {**types("Q4_K"), "blk.1.ffn_down_exps.weight": "Q6_K"}
    assert dict(make_plan(arch, "auto", mixed).formats)["experts_down"] == "int8"
    assert dict(make_plan(arch, "auto", types("F16")).formats) == {}


def test_tensor_parallel_experts_equal_one_device(saved):
    """Two devices split every expert's columns (and the shared expert's) as a dense MLP's: the same tokens."""
    _, model_dir = saved["qwen2_moe"]
    assert generate(model_dir, tensor_parallel_size=2) == generate(model_dir)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_gpt_oss_over_two_devices_equals_transformers(saved, expert_parallel):
    """gpt-oss's experts' biases split with their experts (whole experts, or each expert's I), its sinks with the
    heads: two devices give transformers' tokens."""
    model, model_dir = saved["gpt_oss"]
    got = generate(model_dir, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("quantization", ["auto", "int4"])
def test_expert_parallel_devices_hold_whole_experts_and_give_one_devices_tokens(saved, quantization):
    """--enable-expert-parallel: each of two devices holds 4 of the 8 experts, whole (not every expert's half:
    automatic sharding could gather them all and still give the right tokens), float or in their 4-bit quants
    (whose groups along an expert's input then never split), and the tokens are one device's."""
    _, model_dir = saved["qwen3_moe"]
    engine = dict(ENGINE, quantization=quantization)
    llm = LLM(model_dir, **engine, tensor_parallel_size=2, enable_expert_parallel=True)
    experts = llm.engine.runner.params["layers"]["mlp"]
    for module in ("experts_gate_up", "experts_down"):
        for whole in experts[module].values():
            assert whole.shape[1] == 8 and {s.data.shape[1] for s in whole.addressable_shards} == {4}
            assert {s.data.shape[2:] for s in whole.addressable_shards} == {whole.shape[2:]}
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == generate(model_dir, **engine)


def test_expert_parallel_refuses_experts_that_do_not_split(tmp_path):
    config = tiny_model("mixtral", num_local_experts=3).config
    (tmp_path / "config.json").write_text(config.to_json_string())
    with pytest.raises(ValueError, match="3 experts do not split evenly over tensor_parallel_size=2"):
        LLM(
            str(tmp_path / "config.json"),
            load_format="dummy",
            **ENGINE,
            tensor_parallel_size=2,
            enable_expert_parallel=True,
        )


def test_routing_metrics_count_the_tokens_transformers_routes(saved):
    """`LLM.get_metrics()`: one `jaxllm:moe_expert_tokens` Vector per sparse layer, each expert's tokens since
    start (padding rows of a step's bucket not counted), equal to the top-k of transformers' router logits over
    every token the engine ran; and each layer's imbalance (busiest expert over the mean)."""
    from jaxllm.metrics.reader import Gauge

    model, model_dir = saved["qwen3_moe"]
    llm = LLM(model_dir, **ENGINE)
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = transformers_routing(model, prompts, outputs, layers=range(model.config.num_hidden_layers))
    metrics = llm.get_metrics()
    assert routed_tokens(metrics) == {layer: row.tolist() for layer, row in want.items()}
    imbalance = {int(m.labels["layer"]): m.value for m in metrics if m.name == "jaxllm:moe_expert_load_imbalance"}
    assert all(isinstance(m, Gauge) for m in metrics if m.name == "jaxllm:moe_expert_load_imbalance")
    assert imbalance == pytest.approx({layer: row.max() / row.mean() for layer, row in want.items()})


def transformers_routing(model, prompts, outputs, layers) -> dict[int, np.ndarray]:
    """Sparse layer (of `layers`, in order) → tokens per expert: the top-k of transformers' router logits over
    every token an engine ran for `prompts` (each prompt and its output but the last token, never run)."""
    want = {layer: np.zeros(model.config.num_experts, np.int64) for layer in layers}
    for prompt, out in zip(prompts, outputs, strict=True):
        ran = prompt + list(out.outputs[0].token_ids)[:-1]
        with torch.no_grad():
            logits = model(torch.tensor([ran]), output_router_logits=True).router_logits
        for layer, layer_logits in zip(layers, logits, strict=True):
            for e in torch.topk(layer_logits.float(), model.config.num_experts_per_tok, dim=-1).indices.flatten():
                want[layer][int(e)] += 1
    return want


def routed_tokens(metrics) -> dict[int, list[int]]:
    """`LLM.get_metrics()`'s `jaxllm:moe_expert_tokens`: sparse layer → tokens routed to each expert."""
    from jaxllm.metrics.reader import Vector

    return {int(m.labels["layer"]): m.values for m in metrics if isinstance(m, Vector) and "moe" in m.name}


def test_prompt_logprobs_match_transformers(saved):
    model, model_dir = saved["olmoe"]
    llm = LLM(model_dir, **ENGINE)
    prompt = PROMPTS[1]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=0))
    ref = hf_log_softmax(model, prompt)
    got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i]
    np.testing.assert_allclose(got, [ref[i - 1][t] for i, t in enumerate(prompt) if i], atol=2e-3)


def test_dummy_weights_run_a_moe_config(tmp_path):
    config = tiny_model("qwen3_moe").config
    (tmp_path / "config.json").write_text(config.to_json_string())
    llm = LLM(str(tmp_path / "config.json"), load_format="dummy", **ENGINE)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Qwen2-MoE with a dense MLP layer between two sparse ones (mlp_only_layers): three stacks of layers."""
    model = tiny_model("qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])
    folder = tmp_path_factory.mktemp("mixed")
    model.save_pretrained(folder)
    return model, str(folder)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_dense_layers_between_sparse_ones_equal_transformers(mixed, scan_layers):
    model, model_dir = mixed
    llm = LLM(model_dir, **ENGINE, scan_layers=scan_layers)
    params = llm.engine.runner.params if scan_layers else {}
    assert not scan_layers or {"layers_from_0", "layers_from_1", "layers_from_2"} <= set(params)
    prompts = PROMPTS[:4]
    want = [hf_greedy(model, p, 16) for p in prompts]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert [list(o.outputs[0].token_ids) for o in outputs] == want


@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_stages_split_layers_of_several_kinds(mixed, stages):
    """Sparse, dense, sparse over 2 stages (the first holds a sparse and a dense run) or 3 (a layer each): each
    stage scans its own runs, sliced from the model's stacks, and the tokens stay transformers'."""
    model, model_dir = mixed
    prompts = PROMPTS[:4]
    llm = LLM(model_dir, **ENGINE, pipeline_parallel_size=stages)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_expert_parallel_pipeline_stages_equal_transformers_and_count_every_stages_routing(mixed):
    """Two stages of two devices each, experts split whole (EP): every stage's devices hold half of its sparse
    layers' experts, the tokens are transformers', and the routing metrics gather both stages' sparse layers."""
    model, model_dir = mixed
    prompts = PROMPTS[:4]
    engine = dict(ENGINE, pipeline_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    llm = LLM(model_dir, **engine)
    experts = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(llm.engine.runner.params)[0]
        if any("experts_" in str(getattr(key, "key", "")) for key in path)
    ]
    assert len(experts) >= 4  # gate_up and down of the two sparse layers, one in each stage
    for whole in experts:
        assert {s.data.shape[1] for s in whole.addressable_shards} == {whole.shape[1] // 2}
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    want = transformers_routing(model, prompts, outputs, layers=[0, 2])  # (layer 1 is dense)
    assert routed_tokens(llm.get_metrics()) == {layer: row.tolist() for layer, row in want.items()}


# ---- routing and the grouped matmul alone --------------------------------------------------------------------


def oracle(x, experts, weights, gate_up, down):
    """The experts' weighted sum, token by token, in float64."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(experts[t]), np.asarray(weights[t], np.float64), strict=True):
            h = x[t] @ gate_up[e].reshape(x.shape[1], -1)
            g, u = h.reshape(2, -1)
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("layout", ["random", "one_expert", "idle_expert"])
def test_grouped_experts_equal_a_float64_oracle(num_tokens, layout):
    r = np.random.default_rng(num_tokens)
    num_experts, k, hidden, inner = 8, 2, 32, 16  # N in whole panels of 32: the C++ kernel packs them
    x = r.standard_normal((num_tokens, hidden)).astype(np.float32)
    gate_up = (0.3 * r.standard_normal((num_experts, hidden, 2, inner))).astype(np.float32)
    down = (0.3 * r.standard_normal((num_experts, inner, hidden))).astype(np.float32)
    choices = np.arange(1, num_experts) if layout == "idle_expert" else np.arange(num_experts)  # nobody picks 0
    experts = np.stack([r.choice(choices, k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    if layout == "one_expert":  # every token's first choice is expert 5, its second another
        experts[:, 0] = 5
        experts[:, 1] = r.choice([0, 1, 2, 3, 4, 6, 7], num_tokens)
    weights = r.random((num_tokens, k)).astype(np.float32)
    want = oracle(x, experts, weights, gate_up, down)
    np.testing.assert_allclose(grouped_swiglu(x, experts, weights, gate_up, down), want, rtol=2e-5, atol=2e-5)
    # stacked layers: the running layer's experts, read from the whole stack
    stacked = [np.stack([np.full_like(w, np.nan), w]) for w in (gate_up, down)]
    got = grouped_swiglu(x, experts, weights, *stacked, layer=jnp.int32(1))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the CPU kernel: every tile against its expert packed in place, in one call
    got = grouped_swiglu(x, experts, weights, *packed_experts(stacked), layer=jnp.int32(1))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the Pallas GPU kernel (interpret mode here), on the stack and on one layer's experts
    pallas = [KernelExperts(jnp.asarray(w), "pallas") for w in stacked]
    got = grouped_swiglu(x, experts, weights, *pallas, layer=jnp.int32(1))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    pallas = [KernelExperts(jnp.asarray(w), "pallas") for w in (gate_up, down)]
    np.testing.assert_allclose(grouped_swiglu(x, experts, weights, *pallas), want, rtol=2e-5, atol=2e-5)


def packed_experts(stacked):
    """Each `[L, E, K, *N]` stack (float, or a quantized weight's arrays) packed for the C++ kernel's grouped call."""
    return [KernelExperts(jax.tree.map(pack_experts, w), "cpu") for w in stacked]


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q4_0", "q4_1"])
def test_quantized_experts_equal_the_oracle_on_their_dequantized_weights(fmt):
    """Experts kept in their bits (int8 / int4 quantization): each tile's experts are dequantized after the
    gather; the result is the float64 oracle's on the dequantized weights, stacked layers included."""
    r = np.random.default_rng(3)
    num_experts, k, hidden, inner, num_tokens = 8, 2, 64, 32, 24
    gate_up = random_weight(r, fmt, (num_experts, hidden, 2, inner))
    down = random_weight(r, fmt, (num_experts, inner, hidden))
    floats = [np.stack([dequant(w, e) for e in range(num_experts)]) for w in (gate_up, down)]
    x = r.standard_normal((num_tokens, hidden)).astype(np.float32)
    experts = np.stack([r.choice(num_experts, k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    weights = r.random((num_tokens, k)).astype(np.float32)
    want = oracle(x, experts, weights, *floats)
    got = grouped_swiglu(x, experts, weights, gate_up, down)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    stacked = [QuantizedWeight(*(None if a is None else np.stack([a, a]) for a in w)) for w in (gate_up, down)]
    np.testing.assert_allclose(grouped_swiglu(x, experts, weights, *stacked, layer=jnp.int32(1)), got, rtol=1e-6)
    packed = grouped_swiglu(x, experts, weights, *packed_experts(stacked), layer=jnp.int32(1))  # the C++ kernel
    np.testing.assert_allclose(packed, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_int4_quantization_keeps_the_experts_in_their_bits(saved, monkeypatch):
    """quantization="int4": the experts' stacks are 4-bit quants (half a byte a weight, never float), and the
    tokens are those of the same weights with the CPU kernels off."""
    _, model_dir = saved["qwen3_moe"]
    runs = []
    for kernels in ("on", "off"):
        monkeypatch.setenv("JAXLLM_CPU_KERNELS", kernels)
        llm = LLM(model_dir, **ENGINE, quantization="int4")
        experts = llm.engine.runner.params["layers"]["mlp"]["experts_gate_up"]
        assert set(experts) == {"qweight", "scales", "mins"} and experts["qweight"].dtype == jnp.uint8
        assert experts["qweight"].shape == (2, 8, 32, 2, 32)  # [L, E, H / 2, 2, I]
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], GREEDY, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outputs])
    assert runs[0] == runs[1]


def test_tiles_grow_with_the_rows_per_expert():
    assert [tile_rows(n, 8) for n in (1, 8, 15, 16, 64, 100, 4096)] == [1, 1, 1, 2, 8, 8, 64]


def test_routing_follows_transformers_ties_to_the_lowest_expert():
    """torch's top-k order on exact ties is unspecified: jaxllm's is the lowest expert id first; off ties both
    give the same experts and weights."""
    ties = np.array([[0.5, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]], np.float32)
    weights, experts = route(ties, 2, normalize=True)
    np.testing.assert_array_equal(np.asarray(experts), [[1, 2], [0, 1]])
    np.testing.assert_allclose(np.asarray(weights), [[0.5, 0.5], [0.5, 0.5]], rtol=1e-6)
    logits = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    torch_weights, torch_experts = torch.topk(torch.softmax(torch.tensor(logits), -1), 3)
    weights, experts = route(logits, 3, normalize=False)
    np.testing.assert_array_equal(np.asarray(experts), torch_experts.numpy())
    np.testing.assert_allclose(np.asarray(weights), torch_weights.numpy(), rtol=1e-6)


def test_quantized_checkpoints_are_refused_naming_the_method():
    """A `quantization_config` jaxllm cannot read (all but gpt-oss's MXFP4) is refused at start-up with the method
    named, never loaded as if the tensors were float."""
    from jaxllm.model import arch_from_hf_config

    config = transformers.GptOssConfig(**{**TINY, **MOE_CASES["gpt_oss"][2]}).to_dict()
    config.update(architectures=["GptOssForCausalLM"], quantization_config={"quant_method": "gptq"})
    with pytest.raises(NotImplementedError, match="gptq"):
        arch_from_hf_config(config)
    config.update(architectures=["Qwen3MoeForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(NotImplementedError, match="mxfp4"):
        arch_from_hf_config(config)
    config["architectures"] = ["GptOssForCausalLM"]
    del config["quantization_config"]
    arch = arch_from_hf_config(config)
    assert arch.attention_sinks and arch.moe.biases and arch.moe.clamped_glu == (1.702, 7.0)
    assert arch.layer_windows() == (8, None)


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[..., K]` float → MXFP4 as gpt-oss saves it: (`[..., K/32, 16]` codes two a byte, low nibble first;
    `[..., K/32]` power-of-two exponents + 127), each block scaled so its largest value fits E2M1's 6."""
    from jaxllm.weights.mxfp4 import FP4_VALUES

    blocks = w.reshape(*w.shape[:-1], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = blocks / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)  # the nearest E2M1 value
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(packed), np.ascontiguousarray(exponent + 127, np.uint8)  # (safetensors saves bytes)


def test_gpt_oss_mxfp4_checkpoints_load_dequantized_and_equal_transformers(saved, tmp_path, caplog):
    """gpt-oss's released form: experts as MXFP4 `_blocks`/`_scales` and `quantization_config` mxfp4. jaxllm
    dequantizes them as they load (one log line) and gives the tokens of transformers' model holding transformers'
    own dequantization of the same blocks (`convert_moe_packed_tensors`: the layout is theirs, not ours)."""
    import copy
    import json
    import logging

    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, model_dir = saved["gpt_oss"]
    tensors = load_file(f"{model_dir}/model.safetensors")
    reference = copy.deepcopy(model)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_quantize(tensors.pop(name).transpose(0, 2, 1))  # saved [E, in, out]; blocks along in
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        packed = (torch.from_numpy(blocks), torch.from_numpy(scales))
        dequantized = convert_moe_packed_tensors(*packed, dtype=torch.float32)
        with torch.no_grad():
            reference.get_parameter(name).copy_(dequantized)
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.load(open(f"{model_dir}/config.json"))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = PROMPTS[:4]
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        llm = LLM(str(tmp_path), **ENGINE)
    assert "MXFP4 experts are dequantized" in caplog.text
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    want = [hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    assert not torch.equal(reference.model.layers[0].mlp.experts.down_proj, model.model.layers[0].mlp.experts.down_proj)

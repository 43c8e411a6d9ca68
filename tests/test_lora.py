"""LoRA adapters end to end, on the default model's Q4_1 base: PEFT adapters made here (random A and B: PEFT's
default B = 0 would make every check pass) of different ranks and targets, against transformers with the adapter
merged into the dequantized GGUF; adapters and the base mixed in one batch; the prefix cache scoped by adapter;
no compile across loads, swaps and unloads; FCFS across more adapters than slots; bad adapters refused."""

import copy
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.numpy import load_file, save_file

from jaxllm import LLM, SamplingParams
from jaxllm.lora import LoRARequest
from jaxllm.runner.compilations import compilation_count
from tests.conftest import TEST_ENGINE, kv_bytes
from tests.hf_reference import hf_greedy, hf_log_softmax
from tests.tiny_models import PANEL_LLAMA, random_model

MAX_LORAS = 2
ENGINE = dict(TEST_ENGINE, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=16, kv_cache_memory_bytes=kv_bytes(96))
NUM_TOKENS = 8
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 260, 1345, 30], [9690, 198, 2683, 198, 504, 7, 3875]]
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name → (r, lora_alpha, use_rslora, targets, seed)
    "all8": (8, 16, False, ALL_SEVEN, 0),
    "qv16": (16, 8, True, ["q_proj", "v_proj"], 1),
    "mlp4": (4, 4, False, ["gate_proj", "up_proj", "down_proj"], 2),
    "attn8": (8, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"], 3),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


def make_adapter(base, path, r, alpha, rslora, targets, seed, scale=0.3):
    """A PEFT adapter with random A and B saved at `path`; returns the base with it merged (transformers)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # sized so the adapter changes the output without drowning the model
                p.copy_(torch.randn_like(p) * scale / r**0.5)
    model.save_pretrained(str(path))
    return model.merge_and_unload().eval()


def reference(model) -> list[tuple[list[int], list[float]]]:
    """Per prompt: greedy tokens and their logprobs, then the prompt's own tokens' logprobs (all but the first)."""
    out = []
    for prompt in PROMPTS:
        tokens = hf_greedy(model, prompt, NUM_TOKENS)
        logprobs = hf_log_softmax(model, prompt + tokens)
        generated = [logprobs[len(prompt) - 1 + i, t] for i, t in enumerate(tokens)]
        out.append((tokens, generated, [logprobs[i - 1, prompt[i]] for i in range(1, len(prompt))]))
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_default_model):
    """name → (its LoRARequest, transformers' greedy tokens and their logprobs with it merged); "base": None."""
    root = tmp_path_factory.mktemp("adapters")
    made = {"base": (None, reference(hf_default_model))}
    for i, (name, (r, alpha, rslora, targets, seed)) in enumerate(ADAPTERS.items()):
        merged = make_adapter(hf_default_model, root / name, r, alpha, rslora, targets, seed)
        made[name] = (LoRARequest(name, i + 1, str(root / name)), reference(merged))
        assert made[name][1] != made["base"][1], f"{name} changes nothing: the test would prove nothing"
    return made


@pytest.fixture(scope="module")
def lora_llm():
    return LLM(**ENGINE)


def run(llm, loras):
    """Greedy tokens and logprobs of every prompt with each of `loras` (one generate call: one batch)."""
    prompts = [{"prompt_token_ids": p} for _ in loras for p in PROMPTS]
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    results = []
    for o in outputs:
        c = o.outputs[0]
        results.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]))
    return [results[i : i + len(PROMPTS)] for i in range(0, len(results), len(PROMPTS))]


def assert_matches(got, want, what):
    for i, ((tokens, logprobs), (want_tokens, want_logprobs, _)) in enumerate(zip(got, want, strict=True)):
        assert tokens == want_tokens, f"{what}, prompt {i}: {tokens} != {want_tokens}"
        np.testing.assert_allclose(logprobs, want_logprobs, atol=2e-3, err_msg=f"{what}, prompt {i}")


def test_each_adapter_generates_what_transformers_generates_with_it_merged(lora_llm, adapters):
    for name, (lora, want) in adapters.items():
        (got,) = run(lora_llm, [lora])
        assert_matches(got, want, name)
    assert {a.lora_name for a in lora_llm.engine.list_loras()} == set(ADAPTERS)


def test_prompt_logprobs_are_transformers_with_the_adapter_merged(lora_llm, adapters):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for name, (lora, want) in adapters.items():
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        for i, out in enumerate(lora_llm.generate(prompts, params, use_tqdm=False, lora_request=lora)):
            prompt = PROMPTS[i]
            got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
            np.testing.assert_allclose(got, want[i][2], atol=2e-3, err_msg=f"{name}, prompt {i}")


def test_on_a_float32_base_too(adapters):
    """`quantization="none"`: the GGUF's blocks dequantized at load (the float kernels' path), same references."""
    llm = LLM(**{**ENGINE, "quantization": "none"})
    names = list(adapters)
    for name, got in zip(names, run(llm, [adapters[n][0] for n in names]), strict=True):
        assert_matches(got, adapters[name][1], f"{name} on float32")


def test_one_batch_of_four_adapters_and_the_base_equals_each_alone(lora_llm, adapters):
    names = ["all8", "base", "qv16", "mlp4", "attn8"]  # more adapters than slots: they take turns, FCFS
    got = run(lora_llm, [adapters[n][0] for n in names])
    for name, result in zip(names, got, strict=True):
        assert_matches(result, adapters[name][1], f"{name} in a mixed batch")


def test_more_adapters_than_slots_start_in_arrival_order(lora_llm, adapters):
    loras = [adapters[n][0] for n in ("mlp4", "all8", "qv16", "attn8")]
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * len(loras)
    outputs = lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    started = [o.metrics.first_scheduled_time for o in outputs]
    assert started == sorted(started)
    assert started[MAX_LORAS] > started[MAX_LORAS - 1]  # the third adapter waited for a slot


def cached_tokens(llm, prompt, lora) -> int:
    params = SamplingParams(temperature=0, max_tokens=1)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another(lora_llm, adapters, tmp_path):
    prompt = list(range(100, 148))  # three whole blocks
    lora_a, lora_b = adapters["all8"][0], adapters["qv16"][0]
    assert cached_tokens(lora_llm, prompt, None) == 0
    assert cached_tokens(lora_llm, prompt, lora_a) == 0  # not the base model's blocks
    assert cached_tokens(lora_llm, prompt, lora_b) == 0  # nor another adapter's
    assert cached_tokens(lora_llm, prompt, lora_a) == 32  # its own
    # reloaded under the same name and id with changed weights: its old blocks are not its blocks any more
    changed = tmp_path / "all8-changed"
    shutil.copytree(lora_a.lora_path, changed)
    weights = str(changed / "adapter_model.safetensors")
    save_file({k: np.ascontiguousarray(v * 1.5) for k, v in load_file(weights).items()}, weights)
    assert lora_llm.engine.remove_lora(lora_a.lora_int_id)
    reloaded = LoRARequest(lora_a.lora_name, lora_a.lora_int_id, str(changed))
    assert cached_tokens(lora_llm, prompt, reloaded) == 0
    assert lora_llm.engine.remove_lora(reloaded.lora_int_id)
    lora_llm.engine.add_lora(lora_a)  # (as the other tests made it)


def test_nothing_compiles_across_loads_swaps_and_unloads(lora_llm, adapters):
    before = compilation_count()
    names = ["qv16", "mlp4", "attn8", "all8"]
    run(lora_llm, [adapters[n][0] for n in names])  # every slot rewritten
    lora = adapters["mlp4"][0]
    assert lora_llm.engine.remove_lora(lora.lora_int_id)
    run(lora_llm, [lora, None])  # loaded again
    assert compilation_count() == before


def test_bad_adapters_and_requests_get_their_error_and_the_engine_keeps_serving(lora_llm, adapters, tmp_path):
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    with pytest.raises(FileNotFoundError, match="nowhere"):
        lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 90, str(tmp_path / "nowhere")))
    bad = tmp_path / "dora"
    shutil.copytree(adapters["all8"][0].lora_path, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("dora", 91, str(bad)))
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    with pytest.raises(ValueError, match="max_lora_rank"):
        lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("r32", 92, str(bad)))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, str(bad))
    (got,) = run(lora_llm, [adapters["all8"][0]])
    assert_matches(got, adapters["all8"][1], "after the refusals")


def test_an_engine_without_enable_lora_refuses_adapters(llm, adapters):
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=adapters["all8"][0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama whose heads split over two devices, an adapter, and transformers' greedy tokens with it merged
    and without it."""
    root = tmp_path_factory.mktemp("tiny_lora")
    model = random_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**PANEL_LLAMA))
    model.save_pretrained(root / "hf")
    merged = make_adapter(model, root / "adapter", 8, 16, False, ALL_SEVEN, 0, scale=1.0)
    want, base = hf_greedy(merged, TINY_PROMPT, NUM_TOKENS), hf_greedy(model, TINY_PROMPT, NUM_TOKENS)
    assert want != base
    return str(root / "hf"), LoRARequest("a", 1, str(root / "adapter")), want, base


TINY_PROMPT = [5, 17, 42, 8, 91, 3]


@pytest.mark.parametrize(
    "base_engine",
    [
        dict(tensor_parallel_size=2),
        dict(dtype="bfloat16"),
        dict(quantization="int8"),
        dict(quantization="int4"),
        dict(async_scheduling=True),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}),
    ],
    ids=["tp2", "bfloat16", "int8", "int4", "async", "ngram"],
)
def test_adapters_on_every_base(tiny, base_engine):
    """Two devices (A replicated or split with its input, B with its output), bfloat16 weights, int8 and int4; async
    scheduling (placeholder tokens) and n-gram speculation (drafts verified in the adapter's rows)."""
    path, lora, want, base = tiny
    engine = dict(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, dtype="float32", progress=False)
    llm = LLM(path, **{**engine, **base_engine}, kv_cache_memory_bytes=1 << 20, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": TINY_PROMPT}] * 2, params, use_tqdm=False, lora_request=[lora, None])
    assert [list(o.outputs[0].token_ids) for o in outputs] == [want, base]

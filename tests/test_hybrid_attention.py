"""Layers that attend differently in one model: full attention beside sliding-window layers (transformers'
`layer_types`; Qwen2's `max_window_layers`, Gemma 2's alternation, Gemma 3's five local to one global with their
own RoPE), run through a whole engine against transformers on the same weights.

Each run of layers of one kind is its own scanned stack with its own window (`ModelArch.layer_runs`). The KV cache
has a block table per group of layers of one kind (kv_cache_groups.py): windowed groups hand back the blocks that
leave their window while the engine runs, and every test below runs with them doing so.
"""

import dataclasses
import json

import numpy as np
import pytest
import transformers

from jaxllm import LLM, SamplingParams
from jaxllm.kv_cache_groups import SCRATCH_BLOCK
from jaxllm.model import arch_from_hf_config
from jaxllm.runner.compilations import compilation_count
from tests.gguf_models import write_gguf
from tests.hf_reference import hf_greedy, hf_log_softmax
from tests.served_app import Served
from tests.tiny_models import (
    CHUNKED_ENGINE,
    GEMMA_SPECIAL,
    MOE_CASES,
    TINY_DECODER,
    random_model,
    save_gemma_test_tokenizer,
)

TINY = dict(TINY_DECODER, num_hidden_layers=3)
rng = np.random.default_rng(11)
PROMPTS = [rng.integers(0, TINY["vocab_size"], int(n)).tolist() for n in rng.integers(20, 60, 6)]  # windows long


def test_full_and_sliding_window_layers_equal_transformers(tmp_path):
    """Qwen2 with `max_window_layers=1`: layer 0 attends to everything, layers 1-2 to the last 8 tokens; prompts
    several windows long, prefilled in 16-token chunks beside decodes, then again from the prefix cache."""
    config = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    config.architectures = ["Qwen2ForCausalLM"]
    model = random_model(transformers.Qwen2ForCausalLM, config).eval()
    model.save_pretrained(tmp_path)
    arch = arch_from_hf_config(config)
    assert [(start, end, kind.sliding_window) for start, end, kind in arch.layer_runs()] == [(0, 1, None), (1, 3, 8)]
    want = [hf_greedy(model, p, 24) for p in PROMPTS]
    llm = LLM(str(tmp_path), **CHUNKED_ENGINE)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second time, the prompts' blocks come from the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
    assert llm.engine.stats()["prefix_cache_hits"] > 0


GEMMA = {
    # layers 0, 2 local (an 8-token window), 1, 3 global; soft-caps low enough to bend scores and logits
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16, num_hidden_layers=4, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=8.0
        ),
    ),
    # five local layers (RoPE base 10k) then a global one (base 1M): transformers 5's defaults, window 8
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, num_hidden_layers=6, sliding_window=8)),
}
# every model whose layers attend differently: Gemma's, and gpt-oss's (sinks, alternating 8-token windows, experts)
HYBRID = {**GEMMA, "gpt_oss": MOE_CASES["gpt_oss"]}
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
GEMMA_PROMPTS = [rng.integers(0, TINY["vocab_size"], int(n)).tolist() for n in rng.integers(20, 60, 12)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module", params=list(HYBRID))
def gemma(request, tmp_path_factory):
    """(the transformers model, the engine on its saved weights, with n-gram speculation)."""
    config_cls, model_cls, overrides = HYBRID[request.param]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config.architectures = [model_cls]
    model = random_model(getattr(transformers, model_cls), config).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, LLM(str(path), **CHUNKED_ENGINE, speculative_config=NGRAM)


def test_gemma_greedy_tokens_equal_transformers(gemma):
    """12 prompts up to 7 windows long, 32 tokens each: prefilled in 16-token chunks beside decodes, with n-gram
    drafts verified; then again from the prefix cache."""
    model, llm = gemma
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in GEMMA_PROMPTS]
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in GEMMA_PROMPTS], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_draft_tokens"] > 0


def test_gemma_prompt_logprobs_equal_transformers(gemma):
    model, llm = gemma
    prompt = GEMMA_PROMPTS[0]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=0))
    ref = hf_log_softmax(model, prompt)
    got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i]
    np.testing.assert_allclose(got, [ref[i - 1][t] for i, t in enumerate(prompt) if i], atol=2e-3)


def test_gemma_configs_as_the_hub_writes_them():
    """Hub configs from before transformers 5: `rope_local_base_freq`, `sliding_window_pattern`, no `layer_types`;
    an activation jaxllm does not have is refused, naming it (never run as SiLU)."""
    hub = dict(TINY, architectures=["Gemma3ForCausalLM"], head_dim=16, num_hidden_layers=7, sliding_window=8)
    hub.update(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6, query_pre_attn_scalar=32)
    arch = arch_from_hf_config(hub)
    assert [(start, end, kind.sliding_window) for start, end, kind in arch.layer_runs()] == [
        (0, 5, 8),
        (5, 6, None),
        (6, 7, 8),
    ]
    assert arch.rope.theta == 1e6 and arch.gemma.local_rope.theta == 10000.0
    assert arch.gemma.query_pre_attn_scalar == 32 and arch.hidden_act == "gelu_tanh"  # (Gemma's default)
    with pytest.raises(NotImplementedError, match="relu2"):
        arch_from_hf_config(dict(hub, hidden_activation="relu2"))


def test_windowed_groups_hold_at_most_their_window_in_every_step(gemma):
    """vLLM's bound, checked on every scheduled request of every step (chunked prefill, decodes, n-gram drafts): a
    windowed group holds at most ceil((window - 1 + tokens this step) / block_size) + 1 blocks; the full group holds
    the whole context. Nothing compiles after warm-up, and once all requests end every block of every group is free."""
    _, llm = gemma
    core = llm.engine
    windows, bs = core.kv.windows, core.kv.block_size
    assert len(windows) > 1 and None in windows  # the hybrid manager is on
    schedule, checked = core.scheduler.schedule, []

    def checking_schedule():
        out = schedule()
        for s in out.scheduled:
            for window, table in zip(windows, s.block_ids, strict=True):
                held = sum(b != SCRATCH_BLOCK for b in table)
                if window is None:
                    assert held == len(table) >= -(-(s.start + s.num_new_tokens) // bs)
                else:
                    reserved = max(s.num_new_tokens, len(table) * bs - s.start)  # (rejected drafts' slots stay)
                    assert held <= -(-(window - 1 + reserved) // bs) + 1, (s.start, s.num_new_tokens, table)
                checked.append(held)
        return out

    core.scheduler.schedule = checking_schedule
    compiled = compilation_count()
    try:
        llm.generate([{"prompt_token_ids": p} for p in GEMMA_PROMPTS], GREEDY, use_tqdm=False)
    finally:
        core.scheduler.schedule = schedule
    assert compilation_count() == compiled and checked
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks


def test_gemma_preempted_in_a_small_pool_equals_transformers(tmp_path):
    """Gemma 3 in a pool that holds about two sequences: requests are preempted and recomputed, windowed blocks come
    and go, and the greedy tokens stay transformers'; so do they with the hybrid manager off (every block kept), and
    with the groups' cache sharded over two devices (tensor parallelism), and beside a KV connector."""
    config_cls, model_cls, overrides = GEMMA["gemma3"]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config.architectures = [model_cls]
    model = random_model(getattr(transformers, model_cls), config).eval()
    model.save_pretrained(tmp_path)
    prompts = GEMMA_PROMPTS[:6]
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    small = dict(CHUNKED_ENGINE, kv_cache_memory_bytes=48 * 4096)  # 48 one-layer blocks (a slot per group)
    llm = LLM(str(tmp_path), **small)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks
    uniform = LLM(
        str(tmp_path), **dict(small, kv_cache_memory_bytes=6 * 48 * 4096), disable_hybrid_kv_cache_manager=True
    )
    assert uniform.engine.kv.windows == (None,) and uniform.engine.runner.kv_groups.slots == 6
    outputs = uniform.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    del llm, uniform
    sharded = LLM(str(tmp_path), **small, tensor_parallel_size=2)  # each device its KV heads of every group
    outputs = sharded.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want


def test_kv_connectors_move_each_groups_blocks(tmp_path):
    """Gemma 3's groups beside each KV connector, every group keyed and moved on its own, a windowed group's only
    while it holds them: offloading (a pool so small that blocks are evicted to host memory and come back), shared
    storage (a second engine reads what the first saved, a file per group's block) and P/D transfer (the producer
    offers each group's held blocks only, the consumer decodes from them). Greedy tokens stay transformers'."""
    config_cls, model_cls, overrides = GEMMA["gemma3"]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config.architectures = [model_cls]
    model = random_model(getattr(transformers, model_cls), config).eval()
    model.save_pretrained(tmp_path / "model")
    prompts = [p for p in GEMMA_PROMPTS if len(p) > 40][:4]
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]

    def generate(llm, params=GREEDY):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert len(llm.engine.kv.windows) > 1  # the hybrid manager stays on
        return outputs

    def tokens(outputs):
        return [list(o.outputs[0].token_ids) for o in outputs]

    def idle(llm) -> bool:
        return llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks

    engine = dict(CHUNKED_ENGINE, kv_cache_memory_bytes=24 * 4096)  # 24 blocks: evictions
    offloading = LLM(str(tmp_path / "model"), **engine, kv_offloading_size=0.01)
    for _ in range(2):  # (the second pass reuses what the first left, on the device or offloaded)
        assert tokens(generate(offloading)) == want
    stats = offloading.engine.stats()
    assert stats["kv_transfer_save_count"] > 0 and stats["external_prefix_cache_hits"] > 0 and idle(offloading)
    del offloading

    storage = {"kv_connector": "SharedStorageConnector"}
    storage["kv_connector_extra_config"] = {"shared_storage_path": str(tmp_path / "kv")}
    writer = LLM(str(tmp_path / "model"), **CHUNKED_ENGINE, kv_transfer_config=storage)
    assert tokens(generate(writer)) == want
    writer.engine.kv_connector.worker.flush()
    assert {p.suffixes[0] for p in (tmp_path / "kv").rglob("*.npz")} >= {".npz", ".g1", ".g5"}  # group 0's: no suffix
    reader = LLM(str(tmp_path / "model"), **CHUNKED_ENGINE, kv_transfer_config=storage)
    assert tokens(generate(reader)) == want
    assert reader.engine.stats()["external_prefix_cache_hits"] >= 16 * len(prompts) and idle(reader)
    del writer, reader

    transfer = {"kv_connector": "TransferConnector"}
    producer = LLM(str(tmp_path / "model"), **CHUNKED_ENGINE, kv_transfer_config={**transfer, "kv_role": "kv_producer"})
    consumer = LLM(str(tmp_path / "model"), **CHUNKED_ENGINE, kv_transfer_config={**transfer, "kv_role": "kv_consumer"})
    remote = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    offers = [o.kv_transfer_params for o in generate(producer, remote)]
    groups = len(producer.engine.kv.windows)
    offered = [sum(o["remote_num_blocks"] - start for start in o["remote_group_starts"]) for o in offers]
    assert all(n < groups * o["remote_num_blocks"] for n, o in zip(offered, offers, strict=True))  # windows only
    decode = [dataclasses.replace(GREEDY, extra_args={"kv_transfer_params": o}) for o in offers]
    outputs = consumer.generate([{"prompt_token_ids": p} for p in prompts], decode, use_tqdm=False)
    assert tokens(outputs) == want
    assert [o.num_cached_tokens for o in outputs] == [len(p) - 1 for p in prompts]  # only the last token computed
    assert idle(producer) and idle(consumer)


@pytest.mark.parametrize("name", list(GEMMA))
def test_gemma_gguf_equals_transformers(name, tmp_path):
    """A GGUF as llama.cpp's converter writes Gemma: norms stored as 1 + w, `ffn_norm` the norm before the MLP,
    Gemma 2's soft-caps in the metadata, the window pattern, local RoPE base and query scale left to the
    architecture's defaults (the query scale: head_dim, as every released Gemma but the 27B ones has it);
    projections kept in their Q8_0 blocks. Greedy tokens equal transformers' on the dequantized weights."""
    config_cls, model_cls, overrides = GEMMA[name]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides, "query_pre_attn_scalar": overrides["head_dim"]})
    config.architectures = [model_cls]
    model = random_model(getattr(transformers, model_cls), config).eval()
    reference = write_gguf(model, tmp_path / "model.gguf", "Q8_0", end_of_turn=END_OF_TURN)
    llm = LLM(str(tmp_path / "model.gguf"), **CHUNKED_ENGINE)
    assert llm.engine.loaded.quant.describe() != "none" and len(llm.engine.kv.windows) > 1
    assert END_OF_TURN in llm.engine.eos_token_ids  # llama.cpp's `eot_token_id` stops generation too
    prompts = GEMMA_PROMPTS[:4]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(reference, p, 32) for p in prompts]


END_OF_TURN = GEMMA_SPECIAL.index("<end_of_turn>")  # 5, as in the test tokenizer (Gemma's own is 106)


def test_generation_config_eos_tokens_stop_generation(tmp_path):
    """Gemma 2's config.json names only <eos>; its end-of-turn token is in generation_config.json, and a chat reply
    must stop there (vLLM reads both)."""
    config_cls, model_cls, overrides = GEMMA["gemma2"]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides}, eos_token_id=1)
    config.architectures = [model_cls]
    random_model(getattr(transformers, model_cls), config).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, END_OF_TURN]}))
    llm = LLM(str(tmp_path), **CHUNKED_ENGINE)
    assert {1, END_OF_TURN} <= set(llm.engine.eos_token_ids)
    params = SamplingParams(max_tokens=8, logit_bias={END_OF_TURN: 100.0})  # the first token ends the turn
    (out,) = llm.generate([{"prompt_token_ids": GEMMA_PROMPTS[0]}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == [END_OF_TURN] and out.outputs[0].finish_reason == "stop"


def test_gemma_chat_through_llm_and_the_server(tmp_path):
    """A Gemma 3 model with Gemma's chat format (a test tokenizer: Gemma's own is gated): `LLM.chat` and the
    server's chat completions render the template (system folded into the first user turn, the reply after
    `<start_of_turn>model`), stop at `<end_of_turn>` (generation_config.json's eos) and show no special token."""
    import httpx

    from jaxllm import EngineArgs
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app

    config_cls, model_cls, overrides = GEMMA["gemma3"]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides}, eos_token_id=1, bos_token_id=2)
    config.architectures = [model_cls]
    random_model(getattr(transformers, model_cls), config).save_pretrained(tmp_path)
    save_gemma_test_tokenizer(tmp_path, TINY["vocab_size"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, END_OF_TURN]}))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    end_after_three = {END_OF_TURN: 100.0}  # (min_tokens holds it back for three tokens)
    llm = LLM(str(tmp_path), **CHUNKED_ENGINE)
    (out,) = llm.chat(messages, SamplingParams(max_tokens=8, min_tokens=3, logit_bias=end_after_three), use_tqdm=False)
    assert out.prompt == "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert out.prompt_token_ids[:2] == [2, 4]  # one <bos>: the template's, none added by the tokenizer
    completion = out.outputs[0]
    assert len(completion.token_ids) == 4 and completion.token_ids[-1] == END_OF_TURN
    assert completion.finish_reason == "stop" and "turn>" not in completion.text
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids[:3])
    del llm
    engine = AsyncLLM(EngineArgs(model=str(tmp_path), **{k: v for k, v in CHUNKED_ENGINE.items() if k != "progress"}))
    served = Served(build_app(engine, served_model_names=["gemma"]))
    try:
        body = {"model": "gemma", "messages": messages, "max_tokens": 8, "min_tokens": 3, "logit_bias": {"5": 100}}
        reply = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60).json()
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 4
        assert reply["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
        assert "turn>" not in choice["message"]["content"]
    finally:
        served.stop()
        engine.shutdown()


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_a_converted_checkpoint_generates_what_its_source_does(name, tmp_path):
    """`jaxllm convert` keeps every leaf these models add (sinks, biased experts, Gemma's norms): the Orbax
    checkpoint generates the HF directory's tokens."""
    from jaxllm.entrypoints.convert import convert

    config_cls, model_cls, overrides = HYBRID[name]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config.architectures = [model_cls]
    random_model(getattr(transformers, model_cls), config).save_pretrained(tmp_path / "hf")
    convert(str(tmp_path / "hf"), str(tmp_path / "orbax"), dtype="float32")
    prompts = [{"prompt_token_ids": p} for p in GEMMA_PROMPTS[:3]]
    tokens = [
        [list(o.outputs[0].token_ids) for o in LLM(str(tmp_path / f), **CHUNKED_ENGINE).generate(prompts, GREEDY)]
        for f in ("hf", "orbax")
    ]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_pipeline_stages_split_local_and_global_layers(name, tmp_path):
    """Two pipeline stages: Gemma 3's five local layers and one global split 3 + 3 (the second stage holds two local
    layers, then the global one), gpt-oss's alternation over 1 + 2 layers; every stage's cache holds its layers'
    slots of the hybrid groups, and the tokens are transformers'; every block is back at the end."""
    config_cls, model_cls, overrides = HYBRID[name]
    config = getattr(transformers, config_cls)(**{**TINY, **overrides})
    config.architectures = [model_cls]
    model = random_model(getattr(transformers, model_cls), config).eval()
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **CHUNKED_ENGINE, pipeline_parallel_size=2)
    assert len(llm.engine.kv.windows) > 1 and None in llm.engine.kv.windows  # the hybrid groups
    prompts = GEMMA_PROMPTS[:4]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(model, p, 32) for p in prompts]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks

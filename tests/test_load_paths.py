"""Every way weights reach a step, checked by what the engine generates, not by restored parameters.

A converted checkpoint once restored identical parameters and generated gibberish: the loader reported them laid
out for the CPU kernel while it had not packed them. So each load path (HF directory, Orbax from `jaxllm convert`,
dummy weights; the default model's GGUF) runs a whole engine, and its greedy tokens and their logprobs must equal
a reference's: the same weights through XLA alone (`JAXLLM_CPU_KERNELS=off`, one device), and, for float weights,
transformers' PyTorch model.

Matrix (a tiny random Llama whose projections are whole panels, so the kernels serve every one of them):
source {hf, orbax, dummy} x quantization {auto, int8, int4, none} x {kernels on, kernels off, 2 devices}.
On the default model: its GGUF converted by `jaxllm convert` and generated from by `jaxllm generate` (the reported
journey), float and int8, kernels on and off, against the GGUF's own text.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from jaxllm import LLM, SamplingParams
from jaxllm.entrypoints.convert import convert
from tests.conftest import TEST_ENGINE, kv_bytes, serve_flags
from tests.tiny_models import PANEL_LLAMA, random_model

# few buckets (1-8 tokens, prompts prefill in chunks) and a small cache (sized from free memory, a tiny model's
# would hold millions of tokens)
TINY_ENGINE = dict(
    max_num_seqs=2,
    max_num_batched_tokens=8,
    max_model_len=64,
    dtype="float32",
    kv_cache_memory_bytes=1 << 20,
    progress=False,
)
PROMPTS = [[5, 17, 42, 8, 91, 3], [60, 2, 2, 77], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
SOURCES = ("hf", "orbax", "dummy")
QUANTIZATIONS = ("auto", "int8", "int4", "none")
RUNS = ("kernels", "tp2")  # each compared with the same weights through XLA alone on one device ("xla")


@pytest.fixture(scope="module", autouse=True)
def no_compiled_step_cache():
    """This module's engines compile their steps (JAX's cache serving the default model's) instead of loading ours:
    the three segfaults seen in XLA's CPU deserialization (CI) all came while they loaded, unexplained
    (docs/startup.md). What it checks is how weights load; tests/test_startup.py checks the compiled-step cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXLLM_DISABLE_EXECUTABLE_CACHE", "1")
        yield


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory):
    """source name → what `LLM` takes: a saved tiny Llama, its `jaxllm convert` checkpoint, its bare config."""
    config = transformers.LlamaConfig(**PANEL_LLAMA)
    model = random_model(transformers.LlamaForCausalLM, config)
    root = tmp_path_factory.mktemp("load_paths")
    model.save_pretrained(root / "hf")
    convert(str(root / "hf"), str(root / "orbax"), dtype="float32")
    (root / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    untied = transformers.LlamaConfig(**{**PANEL_LLAMA, "tie_word_embeddings": False})
    random_model(transformers.LlamaForCausalLM, untied).save_pretrained(root / "untied")
    return {
        "hf": str(root / "hf"),
        "orbax": str(root / "orbax"),
        "dummy": str(root / "config.json"),
        "untied": str(root / "untied"),
        "torch": model,
    }


def generate(model: str, run: str, monkeypatch, **engine) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for PROMPTS from a fresh engine; `run`: "kernels" (the C++ kernels on),
    "xla" (off) or "tp2" (two devices, which the kernels do not serve)."""
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "off" if run == "xla" else "on")
    llm = LLM(model, **engine, tensor_parallel_size=2 if run == "tp2" else 1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    results = []
    for o in outputs:
        c = o.outputs[0]
        results.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]))
    return results


def assert_same(got, want, what: str, atol: float = 2e-4) -> None:
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(got, want, strict=True)):
        assert tokens == want_tokens, f"{what}, prompt {i}: {tokens} != {want_tokens}"
        np.testing.assert_allclose(logprobs, want_logprobs, atol=atol, err_msg=f"{what}, prompt {i}")


@pytest.fixture(scope="module")
def references(tiny_sources):
    """(source, quantization) → the tokens of its weights through XLA alone, computed once each."""
    return {}


def reference(tiny_sources, references, source: str, quantization: str, monkeypatch):
    key = (source, quantization)
    if key not in references:
        engine = dict(TINY_ENGINE, quantization=quantization, load_format="dummy" if source == "dummy" else "auto")
        references[key] = generate(tiny_sources[source], "xla", monkeypatch, **engine)
    return references[key]


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("source", SOURCES)
def test_each_load_path_generates_what_xla_generates_from_the_same_weights(
    tiny_sources, references, source, quantization, run, monkeypatch
):
    want = reference(tiny_sources, references, source, quantization, monkeypatch)
    engine = dict(TINY_ENGINE, quantization=quantization, load_format="dummy" if source == "dummy" else "auto")
    got = generate(tiny_sources[source], run, monkeypatch, **engine)
    assert_same(got, want, f"{source} quantization={quantization} {run}")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_an_untied_models_quantized_embedding_is_looked_up_as_stored(
    tiny_sources, references, quantization, monkeypatch
):
    """An untied model's quantized embedding table is only looked up (the LM head is its own kernel): the CPU
    kernels once packed it like the LM head while the lookup read it unpacked, and generated other tokens."""
    want = reference(tiny_sources, references, "untied", quantization, monkeypatch)
    got = generate(tiny_sources["untied"], "kernels", monkeypatch, **dict(TINY_ENGINE, quantization=quantization))
    assert_same(got, want, f"untied quantization={quantization} kernels")


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_the_files_hold_the_same_weights_whichever_loader_reads_them(
    tiny_sources, references, quantization, monkeypatch
):
    """HF directory and its converted checkpoint: the same tokens (int8/int4 quantize the same floats at load)."""
    hf = reference(tiny_sources, references, "hf", quantization, monkeypatch)
    assert_same(reference(tiny_sources, references, "orbax", quantization, monkeypatch), hf, f"orbax {quantization}")


def test_float_weights_generate_what_transformers_generates(tiny_sources, references, monkeypatch):
    model = tiny_sources["torch"]
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens, strict=True)]
        want.append((tokens, logprobs))
    assert_same(reference(tiny_sources, references, "hf", "none", monkeypatch), want, "hf float vs transformers")


# --- the default model ------------------------------------------------------------------------------------------

QUESTION = "What is the capital of France?"
CHAT = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def converted_default(tmp_path_factory):
    """The default model's GGUF converted as the README says (`jaxllm convert --out ...`), float32."""
    out = tmp_path_factory.mktemp("converted") / "smollm2"
    result = jaxllm_cli("convert", "--out", str(out), "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    return str(out)


def jaxllm_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxllm.entrypoints.cli", *args], capture_output=True, text=True, timeout=600
    )


def chat_text(llm) -> str:
    return llm.chat([{"role": "user", "content": QUESTION}], CHAT, use_tqdm=False)[0].outputs[0].text


def test_a_converted_default_model_says_what_its_gguf_says(llm, converted_default):
    """The reported journey, kernels on (as the tests run them): `jaxllm generate --model CHECKPOINT` prints the
    GGUF's answer (its Q4_1 blocks decode as their float32 form: test_quantization.py)."""
    want = chat_text(llm).strip()
    assert "Paris" in want
    result = jaxllm_cli("generate", "--model", converted_default, *serve_flags(), "--max-tokens", "24", QUESTION)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == want


def test_the_converted_default_model_with_the_kernels_off_and_quantized_at_load(llm, converted_default, monkeypatch):
    engine = dict(TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(64))
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "off")
    assert chat_text(LLM(converted_default, **engine)) == chat_text(llm)
    monkeypatch.setenv("JAXLLM_CPU_KERNELS", "on")
    from_checkpoint = chat_text(LLM(converted_default, **engine, quantization="int8"))
    assert from_checkpoint == chat_text(LLM(None, **engine, quantization="int8"))  # the same floats, quantized
    assert "Paris" in from_checkpoint

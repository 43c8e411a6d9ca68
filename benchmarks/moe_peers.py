"""Mixtures of experts beside the peers, in one run with alternated rounds: transformers on a tiny MoE, llama.cpp on
a GGUF of OLMoE-1B-7B's shape.

- `--vs transformers`: a small Qwen3-MoE (random weights from transformers' own config class, saved with
  `save_pretrained`; jaxllm loads that folder), float32 on both sides, greedy decode of 16-token prompts,
  EOS ignored, at each batch size; transformers runs `generate` in this process.
- `--vs llamacpp`: a GGUF of OLMoE-1B-7B's shape written once into jaxllm's cache folder (`olmoe_gguf`: random
  bytes in llama.cpp's layout, every projection and expert Q4_1, embeddings and LM head Q8_0, the default model's
  tokenizer, so the vocabulary is 49152 instead of OLMoE's 50304). jaxllm and llama.cpp
  (`peers/llamacpp_generate.py`, a subprocess each round) read the same file; jaxllm keeps its experts in their bits.
  jaxllm's load time and peak RSS are reported beside the file's bytes.

Medians and per-round ratios (jaxllm / peer) are reported; a round runs every engine once per batch size.

    python benchmarks/moe_peers.py --vs transformers --output-json benchmarks/results/moe_vs_transformers.json
    python benchmarks/moe_peers.py --vs llamacpp --output-json benchmarks/results/moe_vs_llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from moe import OLMOE, peak_rss_bytes, side_by_side

from jaxllm import LLM, SamplingParams
from jaxllm.bench.offline import machine_info

PEERS = Path(__file__).parent / "peers"

# a small Qwen3-MoE: 16 experts of 256, top-4, 4 layers of 512 (transformers' MoE loops over experts in Python)
TINY_QWEN3_MOE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def prompts_of(batch: int, length: int, vocab: int) -> list[list[int]]:
    """`batch` distinct prompts of `length` token ids (no shared prefix: prefix caching has nothing to reuse)."""
    rng = np.random.default_rng(batch)
    return rng.integers(3, vocab, size=(batch, length)).tolist()


def jaxllm_rate(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of one greedy `generate` over `prompts`, prefill included, EOS ignored."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    if any(len(o.outputs[0].token_ids) != output_len for o in outputs):
        raise SystemExit(f"jaxllm: not every request generated {output_len} tokens")
    return len(prompts) * output_len / elapsed


def transformers_rate(model, prompts: list[list[int]], output_len: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - started
    assert out.shape[1] - ids.shape[1] == output_len
    return len(prompts) * output_len / elapsed


def llamacpp_rate(gguf: Path, prompts: list[list[int]], output_len: int, folder: Path) -> float:
    """One timed run of `peers/llamacpp_generate.py` (after its 4-token warm-up) on `gguf`; output tok/s."""
    file = folder / f"prompts_{len(prompts)}.json"
    file.write_text(json.dumps(prompts))
    command = [sys.executable, str(PEERS / "llamacpp_generate.py"), "--gguf", str(gguf), "--prompts", str(file)]
    command += ["--output-len", str(output_len), "--n-batch", "2048"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["output_tokens_per_second"]


def olmoe_gguf(path: Path) -> Path:
    """A GGUF of OLMoE-1B-7B's shape with random weights, written once (streamed: ~4.5 GB, never all in memory)."""
    import gguf

    from jaxllm.weights.default import default_model_path

    if path.is_file():
        return path
    q41, q80 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    tokenizer = gguf.GGUFReader(default_model_path())
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].contents())
    h, experts, size, layers = OLMOE["hidden_size"], 64, 1024, OLMOE["num_hidden_layers"]
    tensors: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]] = [("token_embd.weight", (vocab, h), q80)]
    for i in range(layers):
        tensors += [(f"blk.{i}.{n}.weight", (h,), gguf.GGMLQuantizationType.F32) for n in ("attn_norm", "ffn_norm")]
        tensors += [(f"blk.{i}.attn_{n}.weight", (h, h), q41) for n in ("q", "k", "v", "output")]
        tensors += [(f"blk.{i}.attn_{n}_norm.weight", (h,), gguf.GGMLQuantizationType.F32) for n in "qk"]
        tensors.append((f"blk.{i}.ffn_gate_inp.weight", (experts, h), gguf.GGMLQuantizationType.F32))
        tensors += [(f"blk.{i}.ffn_{n}_exps.weight", (experts, size, h), q41) for n in ("gate", "up")]
        tensors.append((f"blk.{i}.ffn_down_exps.weight", (experts, h, size), q41))
    tensors += [("output_norm.weight", (h,), gguf.GGMLQuantizationType.F32), ("output.weight", (vocab, h), q80)]

    w = gguf.GGUFWriter(None, "olmoe")
    w.add_block_count(layers)
    w.add_context_length(OLMOE["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(size)
    w.add_head_count(OLMOE["num_attention_heads"])
    w.add_head_count_kv(OLMOE["num_key_value_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(experts)
    w.add_expert_used_count(8)
    w.add_vocab_size(vocab)
    for key, field in tokenizer.fields.items():
        if key.startswith("tokenizer.ggml."):
            w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    rng = np.random.default_rng(0)
    for name, shape, kind in tensors:
        block, nbytes = gguf.GGML_QUANT_SIZES[kind]
        byte_shape = (*shape[:-1], shape[-1] // block * nbytes)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind)
    partial = path.with_suffix(".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file(partial)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in tensors:
        w.write_tensor_data(_random_tensor(rng, shape, kind, router=name.endswith("gate_inp.weight")))
    w.close()
    partial.replace(path)
    return path


def _random_tensor(rng, shape: tuple[int, ...], kind, router: bool) -> np.ndarray:
    """Weights of ~N(0, 0.02): float32 (norms near one), or random quants with a scale (and Q4_1's minimum) to match."""
    import gguf

    if kind == gguf.GGMLQuantizationType.F32:
        values = rng.normal(0, 1 if router else 0.02, shape).astype(np.float32)
        return values if router else values + 1.0
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, nbytes), dtype=np.uint8)
    if kind == gguf.GGMLQuantizationType.Q4_1:  # d (f16), m (f16), 16 bytes of 4-bit quants: d * q + m
        blocks[..., 0:2] = np.array([0.005], np.float16).view(np.uint8)
        blocks[..., 2:4] = np.array([-0.0375], np.float16).view(np.uint8)
    else:  # Q8_0: d (f16), 32 int8 quants: d * q
        blocks[..., 0:2] = np.array([0.0003], np.float16).view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vs", choices=["transformers", "llamacpp"], required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    result: dict = {"machine": machine_info(), "args": vars(args), "batches": {}}
    rounds: dict[str, dict[int, list[float]]] = {"jaxllm": {b: [] for b in args.batches}, "peer": {}}
    rounds["peer"] = {b: [] for b in args.batches}
    engine_args = dict(
        dtype="float32",
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(args.batches) * args.input_len,
        max_model_len=args.input_len + args.output_len + 16,
        progress=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.vs == "transformers":
            import torch
            import transformers

            torch.manual_seed(0)
            torch.set_num_threads(os.cpu_count() or 1)
            peer = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY_QWEN3_MOE)).eval()
            peer.save_pretrained(folder / "model")
            llm = LLM(str(folder / "model"), **engine_args)  # (no tokenizer: prompts are token ids)
            vocab = TINY_QWEN3_MOE["vocab_size"]
            result["peer"] = f"transformers {transformers.__version__} torch {torch.__version__}"

            def peer_rate(prompts):
                return transformers_rate(peer, prompts, args.output_len)
        else:
            from jaxllm.weights.default import cache_dir

            gguf = olmoe_gguf(cache_dir() / "gguf" / "olmoe-1b-7b-shape-random.Q4_1.gguf")
            rss = peak_rss_bytes()
            started = time.perf_counter()
            llm = LLM(str(gguf), **engine_args)
            result["load"] = {
                "file_bytes": gguf.stat().st_size,
                "start_seconds": time.perf_counter() - started,
                "peak_rss_growth_bytes": peak_rss_bytes() - rss,
                "kv_cache_bytes": sum(a.nbytes for a in jax.tree.leaves(llm.engine.runner.cache)),
            }
            print(json.dumps(result["load"]), flush=True)
            vocab = 49152
            result["peer"] = "llama.cpp (llama-cpp-python)"

            def peer_rate(prompts):
                return llamacpp_rate(gguf, prompts, args.output_len, folder)

        for _ in range(args.rounds):
            for batch in args.batches:
                prompts = prompts_of(batch, args.input_len, vocab)
                rounds["jaxllm"][batch].append(jaxllm_rate(llm, prompts, args.output_len))
                rounds["peer"][batch].append(peer_rate(prompts))
                print(f"batch {batch}: jaxllm {rounds['jaxllm'][batch][-1]:.1f}, peer {rounds['peer'][batch][-1]:.1f}")
    for batch in args.batches:
        result["batches"][str(batch)] = side_by_side(
            batch, ("jaxllm", rounds["jaxllm"][batch]), ("peer", rounds["peer"][batch])
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""A mixture of experts against a dense model with the same active parameters: decode output tok/s by batch size.

Two random-weight models (`load_format="dummy"`, float32) of Qwen3's layout: a MoE with E experts of which each
token takes k, and a dense model whose MLP is k experts wide (the same active parameters per token). A decode step
of the MoE reads only the experts its tokens chose (model/moe.py), so at batch 1 it should cost about what the
dense model costs; larger batches touch more experts. Both engines live in one process and take turns, round by
round, so a noisy machine weighs on both alike; medians and per-round ratios are reported.

    python benchmarks/moe.py --rounds 3 --batches 1 16 64 --output-json benchmarks/results/moe_cpu.json
    python benchmarks/moe.py --rounds 3 --quantization int4 --output-json benchmarks/results/moe_int4_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from jaxllm import LLM, SamplingParams
from jaxllm.bench.offline import machine_info

LAYOUT = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def configs(num_experts: int, top_k: int, expert_size: int) -> dict[str, dict]:
    moe = {
        **LAYOUT,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_size,
        "intermediate_size": top_k * expert_size,
        "norm_topk_prob": True,
    }
    dense = {
        **LAYOUT,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": top_k * expert_size,
    }
    return {"moe": moe, "dense_same_active": dense}


def decode_rate(llm: LLM, batch: int, output_len: int) -> float:
    """Output tokens per second of `batch` 16-token prompts decoding `output_len` tokens each."""
    prompts = [{"prompt_token_ids": [100 + i + j for j in range(16)]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * output_len / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", help="int8 / int4: both models' weights, the experts' included, kept in bits")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    engines = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, config in configs(args.num_experts, args.top_k, args.expert_size).items():
            path = Path(folder) / f"{name}.json"
            path.write_text(json.dumps(config))
            started = time.perf_counter()
            engines[name] = LLM(
                str(path),
                load_format="dummy",
                dtype="float32",
                max_num_seqs=max(args.batches),
                max_num_batched_tokens=max(256, max(args.batches)),
                max_model_len=256,
                progress=False,
                quantization=args.quantization,
            )
            print(f"{name}: started in {time.perf_counter() - started:.1f} s")
    rounds: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in engines}
    for _ in range(args.rounds):
        for batch in args.batches:
            for name, llm in engines.items():
                rounds[name][batch].append(decode_rate(llm, batch, args.output_len))
    result = {"machine": machine_info(), "args": vars(args), "batches": {}}
    for batch in args.batches:
        moe, dense = rounds["moe"][batch], rounds["dense_same_active"][batch]
        ratios = [m / d for m, d in zip(moe, dense, strict=True)]
        result["batches"][str(batch)] = {
            "moe_output_tokens_per_second": statistics.median(moe),
            "dense_output_tokens_per_second": statistics.median(dense),
            "moe_over_dense": statistics.median(ratios),
            "per_round_ratios": ratios,
        }
        print(
            f"batch {batch:3d}: MoE {statistics.median(moe):7.1f} tok/s, dense (same active) "
            f"{statistics.median(dense):7.1f} tok/s, ratio {statistics.median(ratios):.2f} (rounds {ratios})"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""A mixture of experts against a dense model with the same active parameters: decode output tok/s by batch size.

Two random-weight models (`load_format="dummy"`, float32) of Qwen3's layout: a MoE with E experts of which each
token takes k, and a dense model whose MLP is k experts wide (the same active parameters per token). A decode step
of the MoE reads only the experts its tokens chose (model/moe.py), so at batch 1 it should cost about what the
dense model costs; larger batches touch more experts. Both engines live in one process and take turns, round by
round, so a noisy machine weighs on both alike; medians and per-round ratios are reported.

    python benchmarks/moe.py --rounds 3 --batches 1 16 64 --output-json benchmarks/results/moe_cpu.json
    python benchmarks/moe.py --rounds 3 --quantization int4 --output-json benchmarks/results/moe_int4_cpu.json
    python benchmarks/moe.py --olmoe --quantization int4 --rounds 1 --output-json benchmarks/results/moe_olmoe_int4.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import jax

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


# OLMoE-1B-7B's shape (allenai/OLMoE-1B-7B-0924): 64 experts of 1024, top-8, 16 layers of 2048; ~6.9B weights,
# ~1.3B active per token
OLMOE = dict(
    vocab_size=50304,
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def configs(num_experts: int, top_k: int, expert_size: int, layout: dict) -> dict[str, dict]:
    moe = {
        **layout,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_size,
        "intermediate_size": top_k * expert_size,
        "norm_topk_prob": True,
    }
    dense = {
        **layout,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": top_k * expert_size,
    }
    return {"moe": moe, "dense_same_active": dense}


def side_by_side(batch: int, ours: tuple[str, list[float]], theirs: tuple[str, list[float]]) -> dict:
    """Two engines' per-round output tok/s at one batch size: their medians and the median of the per-round ratios
    (ours / theirs), as the results' JSON holds them; printed on one line."""
    (a, mine), (b, other) = ours, theirs
    ratios = [m / o for m, o in zip(mine, other, strict=True)]
    print(
        f"batch {batch:3d}: {a} {statistics.median(mine):7.1f} tok/s, {b} {statistics.median(other):7.1f} tok/s, "
        f"ratio {statistics.median(ratios):.2f} (rounds {[round(r, 2) for r in ratios]})"
    )
    return {
        f"{a}_output_tokens_per_second": statistics.median(mine),
        f"{b}_output_tokens_per_second": statistics.median(other),
        f"{a}_over_{b}": statistics.median(ratios),
        "per_round_ratios": ratios,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def decode_rate(llm: LLM, batch: int, output_len: int) -> float:
    """Output tokens per second of `batch` 16-token prompts decoding `output_len` tokens each."""
    prompts = [{"prompt_token_ids": [100 + i + j for j in range(16)]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    if any(len(o.outputs[0].token_ids) != output_len for o in outputs):  # a failed step must not read as speed
        raise SystemExit(f"batch {batch}: not every request generated {output_len} tokens (see the errors above)")
    return batch * output_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", help="int8 / int4: both models' weights, the experts' included, kept in bits")
    parser.add_argument("--olmoe", action="store_true", help="OLMoE-1B-7B's shape (64 experts of 1024, top-8)")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    engines, loads = {}, {}
    if args.olmoe:
        args.num_experts, args.top_k, args.expert_size = 64, 8, 1024
    with tempfile.TemporaryDirectory() as folder:
        for name, config in configs(
            args.num_experts, args.top_k, args.expert_size, OLMOE if args.olmoe else LAYOUT
        ).items():
            rss_before = peak_rss_bytes()
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
            weights = sum(a.nbytes for a in jax.tree.leaves(engines[name].engine.runner.params))
            # the process's peak so far: the MoE loads first, so its figure is its own
            loads[name] = {
                "start_seconds": time.perf_counter() - started,
                "weights_bytes": weights,
                "peak_rss_growth_bytes": peak_rss_bytes() - rss_before,
            }
            print(
                f"{name}: started in {loads[name]['start_seconds']:.1f} s, weights {weights / 1e9:.2f} GB, peak RSS "
                f"+{loads[name]['peak_rss_growth_bytes'] / 1e9:.2f} GB"
            )
    rounds: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in engines}
    for _ in range(args.rounds):
        for batch in args.batches:
            for name, llm in engines.items():
                rounds[name][batch].append(decode_rate(llm, batch, args.output_len))
    result = {"machine": machine_info(), "args": vars(args), "load": loads, "batches": {}}
    for batch in args.batches:
        result["batches"][str(batch)] = side_by_side(
            batch, ("moe", rounds["moe"][batch]), ("dense", rounds["dense_same_active"][batch])
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

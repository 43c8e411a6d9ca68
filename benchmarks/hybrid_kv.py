"""The hybrid KV cache manager against every layer keeping every block: long sequences admitted, and decode speed.

A random-weight model of Gemma-3-1B's shape (`load_format="dummy"`: 26 layers, 5 sliding-window layers of 512 tokens
to 1 global, one KV head of 256) with `max_model_len` 8192 and a fixed `kv_cache_memory_bytes`, run twice: with the
hybrid manager (windowed groups keep only their window) and with `disable_hybrid_kv_cache_manager`.

- **Admitted**: how many sequences of `--context` tokens the engine's own pool holds at once, each prefilled in
  `max_num_batched_tokens` chunks through its KV manager as the scheduler would (no forward runs: prefilling many 8k
  sequences of a 1B model on 2 cores would take minutes each).
- **Decode**: output tok/s of decode steps at that batch, every sequence at ~`--context` tokens of context, through
  the engine's compiled step (the K/V is whatever the pool holds: the step costs the same).
- **Beside transformers**: batch-1 decode of a 16-token prompt, 32 tokens, jaxllm (hybrid) against transformers'
  Gemma3ForCausalLM of the same shape and dtype, random weights.

Engines and transformers take turns round by round (a noisy machine weighs on all alike); medians and per-round
ratios are reported.

    python benchmarks/hybrid_kv.py --rounds 3 --output-json benchmarks/results/hybrid_kv_gemma3_1b.json
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
from jaxllm.request import Request
from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput

# google/gemma-3-1b-pt's config.json (text): the shape, windows and RoPE bases
GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    max_position_embeddings=32768,
    sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
)


def admit(llm: LLM, context: int, limit: int, computed: int) -> list[Request]:
    """Sequences of `context` tokens with `computed` of them computed (the rest leave room for the decode steps),
    as many as the pool holds (at most `limit`), each prefilled in the engine's chunks through its KV manager."""
    core = llm.engine
    kv, chunk = core.kv, core.config.scheduler.max_num_batched_tokens
    admitted: list[Request] = []
    while len(admitted) < limit:
        tokens = [(len(admitted) * 7919 + i) % 50000 + 1 for i in range(context)]  # distinct: no prefix sharing
        params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)  # greedy, as batch 1 below
        request = Request(f"seq{len(admitted)}", tokens, params)
        while request.num_computed_tokens < context:
            n = min(chunk, context - request.num_computed_tokens)
            if not kv.allocate_slots(request, n):
                kv.free(request)
                return admitted
            request.num_computed_tokens += n
        request.num_computed_tokens = computed
        request.prompt_token_ids = tokens[: computed + 1]  # the next step decodes from position `computed`
        admitted.append(request)
    return admitted


def decode_rate(llm: LLM, requests: list[Request], steps: int) -> float:
    """Output tok/s of `steps` decode steps of every request (one warm-up step first), through the compiled step."""
    core = llm.engine

    def step() -> None:
        out = SchedulerOutput(step=-1)
        for request in requests:
            if not core.kv.allocate_slots(request, 1):
                raise SystemExit("the pool ran out while decoding: lower --context or raise --kv-cache-gib")
            tables = core.kv.block_tables(request.request_id)
            out.add(ScheduledRequest(request, 1, request.num_computed_tokens, tables))
        sampled = core.runner.execute(out).token_ids
        for request, token in zip(requests, sampled.tolist(), strict=True):
            request.num_computed_tokens += 1
            request.output_token_ids.append(int(token))

    step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return len(requests) * steps / (time.perf_counter() - started)


def jaxllm_batch1(llm: LLM, output_len: int) -> float:
    prompt = {"prompt_token_ids": list(range(100, 116))}
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    started = time.perf_counter()
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == output_len
    return output_len / (time.perf_counter() - started)


def transformers_batch1(model, output_len: int) -> float:
    import torch

    ids = torch.arange(100, 116).unsqueeze(0)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    assert out.shape[1] == 16 + output_len
    return output_len / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the most sequences admitted (the buckets')")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    parser.add_argument("--output-len", type=int, default=32, help="batch-1 tokens beside transformers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    machine = machine_info()  # (the load average before anything runs)
    engines, starts = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gemma3_1b.json"
        path.write_text(json.dumps(GEMMA3_1B))
        for name in ("hybrid", "every_block"):
            started = time.perf_counter()
            engines[name] = LLM(
                str(path),
                load_format="dummy",
                dtype=args.dtype,
                max_model_len=args.context,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=max(args.max_num_seqs, 64),
                kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
                disable_hybrid_kv_cache_manager=name == "every_block",
                progress=False,
            )
            starts[name] = time.perf_counter() - started
            print(f"{name}: started in {starts[name]:.0f} s, {engines[name].engine.runner.num_blocks} blocks")
    hf_model = None
    if not args.no_transformers:
        import torch
        import transformers

        config = transformers.Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B.items() if k != "architectures"})
        hf_model = transformers.Gemma3ForCausalLM._from_config(config, torch_dtype=getattr(torch, args.dtype)).eval()
    computed = args.context - (args.steps + 1) * args.rounds - 1  # every decode step stays within max_model_len
    sequences = {name: admit(llm, args.context, args.max_num_seqs, computed) for name, llm in engines.items()}
    for name, requests in sequences.items():
        kv = engines[name].engine.kv
        print(f"{name}: {len(requests)} sequences of {args.context} tokens admitted ({kv.num_free_blocks} blocks left)")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    batch1: dict[str, list[float]] = {"jaxllm": [], "transformers": []}
    for round_ in range(args.rounds):
        for name, llm in engines.items():
            rates[name].append(decode_rate(llm, sequences[name], args.steps))
        hybrid_llm = engines["hybrid"]
        for request in sequences["hybrid"]:  # room for the batch-1 request
            hybrid_llm.engine.kv.free(request)
        batch1["jaxllm"].append(jaxllm_batch1(hybrid_llm, args.output_len))
        sequences["hybrid"] = admit(hybrid_llm, args.context, len(sequences["hybrid"]), computed)
        if hf_model is not None:
            batch1["transformers"].append(transformers_batch1(hf_model, args.output_len))
        print(f"round {round_ + 1}: decode {rates}, batch 1 {batch1}")
    ratios = [h / u for h, u in zip(rates["hybrid"], rates["every_block"], strict=True)]
    result = {
        "machine": machine,
        "args": vars(args),
        "start_seconds": starts,
        "admitted": {name: len(s) for name, s in sequences.items()},
        "admitted_ratio": len(sequences["hybrid"]) / max(len(sequences["every_block"]), 1),
        "decode_output_tokens_per_second": {name: statistics.median(r) for name, r in rates.items()},
        "decode_rounds": rates,
        "decode_ratio": statistics.median(ratios),
        "decode_per_round_ratios": ratios,
        "batch1_output_tokens_per_second": {k: statistics.median(v) for k, v in batch1.items() if v},
        "batch1_rounds": batch1,
    }
    if batch1["transformers"]:
        per_round = [j / t for j, t in zip(batch1["jaxllm"], batch1["transformers"], strict=True)]
        result["batch1_over_transformers"] = statistics.median(per_round)
        result["batch1_per_round_ratios"] = per_round
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "args")}, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

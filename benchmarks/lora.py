"""What serving LoRA adapters costs: output tok/s of the default model with and without adapters, in one run with
alternated rounds, and how long an adapter takes from its file to its first token.

Per base precision (the default model's Q4_1 blocks, `quantization="auto"`; or float32, `quantization="none"`;
`dtype="float32"` in both) two engines are created up front: `base` (no LoRA) and one with `enable_lora=True,
max_loras=8, max_lora_rank=16`. Each round then runs, at each batch size B (B prompts in one `generate`):

- `base`: the engine without LoRA;
- `lora_off_batch`: the LoRA engine, no adapter in the batch (goal >= 0.98x base);
- `one_adapter`: the LoRA engine, every request with the same adapter (goal >= 0.85x base);
- `eight_adapters`: the LoRA engine, 8 adapters spread over the batch, B >= 8 only (goal >= 0.75x base).

Prompts are distinct 128-token prompts (no shared prefix, the prefix cache reset before each run), 128 output tokens,
greedy, EOS ignored. The adapters are PEFT adapters written into a temporary folder at start (rank 16, all seven
projections, random A and B sized as tests/test_lora.py sizes them so the outputs stay sane). After the rounds:
adapter load time (`engine.add_lora`: file read and checked) and the time to first token of a 128-token prompt
(max_tokens=1) right after loading a new adapter (its slot written on that first step) against a warm adapter
and against no adapter. Medians and per-round ratios against `base` are reported.

    python benchmarks/lora.py --rounds 3 --out benchmarks/results/lora_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.bench.offline import machine_info
from jaxllm.lora import LoRARequest

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16
NUM_ADAPTERS = 8
FRESH_ADAPTERS = 3  # per base precision, for the load time and first-token measures
INPUT_LEN = OUTPUT_LEN = 128
QUANTIZATION = {"q4_1": "auto", "float32": "none"}  # the default GGUF keeps its Q4_1 blocks under "auto"
GOALS = {"lora_off_batch": 0.98, "one_adapter": 0.85, "eight_adapters": 0.75}


def kv_bytes(num_blocks: int) -> int:
    """The KV budget for `num_blocks` blocks of the default model (30 layers, 3 KV heads of 64, float32, blocks
    of 16 tokens), as tests/conftest.py's `kv_bytes`."""
    return num_blocks * 2 * 30 * 16 * 3 * 64 * 4


def isa_flags() -> dict[str, bool]:
    """Whether /proc/cpuinfo lists the vector extensions the kernels care about."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return {flag: flag in flags for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")}


def make_adapters(root: Path, count: int) -> list[Path]:
    """`count` PEFT adapters (rank 16, all seven projections, random A and B) of the default model under `root`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from jaxllm.weights.default import default_model_path

    path = default_model_path()
    base = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    config = LoraConfig(r=RANK, lora_alpha=16, target_modules=ALL_SEVEN, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), config)
    folders = []
    for seed in range(count):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    torch.nn.init.kaiming_uniform_(p, a=5**0.5)
                elif "lora_B" in name:  # as tests/test_lora.py: changes the output without drowning the model
                    p.copy_(torch.randn_like(p) * 0.3 / RANK**0.5)
        folders.append(root / f"adapter{seed}")
        model.save_pretrained(str(folders[-1]))
    return folders


def prompts_of(batch: int, seed: int) -> list[dict]:
    """`batch` distinct prompts of INPUT_LEN token ids (nothing for the prefix cache to reuse)."""
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": p} for p in rng.integers(3, 49152, size=(batch, INPUT_LEN)).tolist()]


def rate(llm: LLM, prompts: list[dict], loras, output_len: int = OUTPUT_LEN) -> float:
    """Output tok/s of one greedy `generate` over `prompts` (prefill included, EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - started
    if any(len(o.outputs[0].token_ids) != output_len for o in outputs):  # a failed step must not read as speed
        raise SystemExit(f"not every request generated {output_len} tokens (see the errors above)")
    return len(prompts) * output_len / elapsed


def first_token(llm: LLM, lora, seed: int) -> dict:
    """One 128-token prompt, max_tokens=1: the engine's TTFT (first_token_time - arrival_time) and the call's time."""
    llm.engine.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    (out,) = llm.generate(prompts_of(1, seed), params, use_tqdm=False, lora_request=lora)
    wall = time.perf_counter() - started
    m = out.metrics
    ttft = m.first_token_time - m.arrival_time if m is not None and m.first_token_time is not None else None
    return {"ttft_s": ttft, "call_s": wall}


def configs(batch: int, adapters: list[LoRARequest]) -> dict[str, tuple[str, object]]:
    """name → (engine, lora_request) of the configurations measured at `batch`."""
    runs = {
        "base": ("base", None),
        "lora_off_batch": ("lora", None),
        "one_adapter": ("lora", adapters[0]),
    }
    if batch >= NUM_ADAPTERS:
        runs["eight_adapters"] = ("lora", [adapters[i % NUM_ADAPTERS] for i in range(batch)])
    return runs


def load_and_first_token(llm: LLM, fresh: list[LoRARequest], warm: LoRARequest) -> dict:
    """Per new adapter: `add_lora`'s time, then the first request's TTFT with it (its slot written) beside a warm
    adapter's and the base's; medians, and the new adapter's extra over the warm one."""
    samples = []
    for i, lora in enumerate(fresh):
        started = time.perf_counter()
        llm.engine.add_lora(lora)
        add_s = time.perf_counter() - started
        new = first_token(llm, lora, 1000 + i)
        samples.append(
            {
                "adapter": lora.lora_name,
                "add_lora_s": add_s,
                "new_adapter": new,
                "warm_same_adapter": first_token(llm, lora, 1000 + i),
                "warm_other_adapter": first_token(llm, warm, 1000 + i),
                "no_adapter": first_token(llm, None, 1000 + i),
            }
        )
    med = {
        key: statistics.median(s[key]["ttft_s"] for s in samples)
        for key in ("new_adapter", "warm_same_adapter", "warm_other_adapter", "no_adapter")
    }
    add = statistics.median(s["add_lora_s"] for s in samples)
    extra = statistics.median(s["new_adapter"]["call_s"] - s["warm_same_adapter"]["call_s"] for s in samples)
    summary = {
        "add_lora_s": add,
        "first_request_extra_s": extra,
        "file_to_usable_s": add + max(extra, 0.0),
        "ttft_s": med,
        "new_over_warm_ttft": med["new_adapter"] / med["warm_same_adapter"],
    }
    print(
        f"  adapter load: add_lora {add * 1e3:.1f} ms, first request +{extra * 1e3:.1f} ms; TTFT new "
        f"{med['new_adapter'] * 1e3:.1f} ms, warm {med['warm_same_adapter'] * 1e3:.1f} ms "
        f"({summary['new_over_warm_ttft']:.2f}x), no adapter {med['no_adapter'] * 1e3:.1f} ms",
        flush=True,
    )
    return {"samples": samples, **summary}


def bench_base(precision: str, args, adapters: list[LoRARequest], fresh: list[LoRARequest]) -> dict:
    from jaxllm.runner.compilations import compilation_count

    engine_args = dict(
        dtype="float32",
        quantization=QUANTIZATION[precision],
        max_num_seqs=64,
        max_num_batched_tokens=512,
        max_model_len=512,
        kv_cache_memory_bytes=kv_bytes(max(args.batch_sizes) * (INPUT_LEN + OUTPUT_LEN) // 16 + 64),
        progress=False,
    )
    starts = {}
    engines = {}
    for name, extra in (("base", {}), ("lora", dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK))):
        started = time.perf_counter()
        engines[name] = LLM(**engine_args, **extra)
        starts[name] = time.perf_counter() - started
        print(f"{precision} {name}: ready in {starts[name]:.1f} s", flush=True)
    # warm-up: every configuration and batch size once, a few tokens (adapters read, slots written, shapes compiled)
    started = time.perf_counter()
    for batch in args.batch_sizes:
        for engine, loras in configs(batch, adapters).values():
            rate(engines[engine], prompts_of(batch, 999), loras, output_len=4)
    warmup_s = time.perf_counter() - started
    compiles_before = compilation_count()
    rounds: dict[int, dict[str, list[float]]] = {b: {} for b in args.batch_sizes}
    for r in range(args.rounds):
        for batch in args.batch_sizes:
            line = []
            for name, (engine, loras) in configs(batch, adapters).items():
                tps = rate(engines[engine], prompts_of(batch, 100 * r + batch), loras)
                rounds[batch].setdefault(name, []).append(tps)
                line.append(f"{name} {tps:.1f}")
            print(f"{precision} round {r + 1} B={batch}: " + ", ".join(line), flush=True)
    compiles_in_rounds = compilation_count() - compiles_before
    result: dict = {
        "engine_args": engine_args,
        "start_s": starts,
        "warmup_s": warmup_s,
        "compilations_during_rounds": compiles_in_rounds,
        "batches": {},
    }
    for batch, by_name in rounds.items():
        base = by_name["base"]
        entry = {"base": {"per_round_tok_s": base, "median_tok_s": statistics.median(base)}}
        for name, tps in by_name.items():
            if name == "base":
                continue
            ratios = [t / b for t, b in zip(tps, base, strict=True)]
            entry[name] = {
                "per_round_tok_s": tps,
                "median_tok_s": statistics.median(tps),
                "per_round_over_base": ratios,
                "median_over_base": statistics.median(ratios),
                "goal": GOALS[name],
                "meets_goal": statistics.median(ratios) >= GOALS[name],
            }
        result["batches"][str(batch)] = entry
    result["adapter_load"] = load_and_first_token(engines["lora"], fresh, adapters[0])
    del engines
    gc.collect()
    return result


def fresh_adapters(root: Path, source: Path, precision: str, first_id: int) -> list[LoRARequest]:
    """FRESH_ADAPTERS new adapters (`source`'s weights scaled, so each has its own digest) for one base precision."""
    from safetensors.numpy import load_file, save_file

    out = []
    for i in range(FRESH_ADAPTERS):
        folder = root / f"fresh_{precision}_{i}"
        folder.mkdir()
        for file in source.iterdir():
            if file.name != "adapter_model.safetensors":
                (folder / file.name).write_bytes(file.read_bytes())
        weights = load_file(str(source / "adapter_model.safetensors"))
        scale = np.float32(1.0 + 0.1 * (i + 1))
        save_file(
            {k: np.ascontiguousarray(v * scale) for k, v in weights.items()}, str(folder / "adapter_model.safetensors")
        )
        out.append(LoRARequest(folder.name, first_id + i, str(folder)))
    return out


def print_table(results: dict) -> None:
    print(f"\n{'base':8s} {'B':>3s} {'config':15s} {'tok/s':>8s} {'x base':>7s} {'goal':>5s}  per-round ratios")
    for precision, res in results.items():
        for batch, entry in res["batches"].items():
            for name, e in entry.items():
                ratio = e.get("median_over_base")
                print(
                    f"{precision:8s} {batch:>3s} {name:15s} {e['median_tok_s']:8.1f} "
                    + (
                        f"{ratio:7.3f} {e['goal']:5.2f}  {[round(x, 3) for x in e['per_round_over_base']]}"
                        if ratio is not None
                        else f"{'':7s} {'':5s}"
                    )
                )
        load = res["adapter_load"]
        print(
            f"{precision:8s} adapter load {load['file_to_usable_s'] * 1e3:.1f} ms (add_lora "
            f"{load['add_lora_s'] * 1e3:.1f} ms), TTFT new/warm {load['new_over_warm_ttft']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bases", default="q4_1,float32", help="comma-separated: q4_1, float32")
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated (at most 64: max_num_seqs)")
    parser.add_argument("--out", help="write the results' JSON here")
    args = parser.parse_args()
    args.bases = [b.strip() for b in args.bases.split(",") if b.strip()]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    unknown = set(args.bases) - set(QUANTIZATION)
    if unknown or max(args.batch_sizes) > 64:
        parser.error(f"unknown bases {sorted(unknown)} or a batch size over 64")
    began = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    result: dict = {
        "workload": {"input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "greedy": True, "ignore_eos": True},
        "args": vars(args),
        "machine": {**machine_info(), "isa_flags": isa_flags()},
        "bases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        folders = make_adapters(root, NUM_ADAPTERS)
        result["adapters"] = {"count": NUM_ADAPTERS, "rank": RANK, "targets": ALL_SEVEN, "lora_alpha": 16}
        print(f"{NUM_ADAPTERS} adapters written in {time.perf_counter() - started:.1f} s", flush=True)
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(f)) for i, f in enumerate(folders)]
        for n, precision in enumerate(args.bases):
            fresh = fresh_adapters(root, folders[0], precision, 100 + 10 * n)
            result["bases"][precision] = bench_base(precision, args, adapters, fresh)
            if args.out:  # after each base precision: a run cut short keeps what it measured
                Path(args.out).write_text(json.dumps(result, indent=2))
    result["machine"]["load_average_before"] = load_before
    result["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = time.perf_counter() - began
    print_table(result["bases"])
    print(
        f"wall {result['wall_s']:.0f} s, load average before {load_before}, "
        f"after {result['machine']['load_average_after']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""TTFT of a repeated long prefix: recomputed, loaded from host memory, from storage, or pulled from a producer.

Four engines of the default model in one process, each timed on the same prompt in every round, interleaved:
- `recompute`: no connector; the device prefix cache is reset before each run, so the prompt is computed;
- `host`: the OffloadingConnector with a device pool of one prompt and a bit; another prompt of the same length
  runs first each round and evicts this one's blocks to host memory, from where they come back;
- `storage`: the SharedStorageConnector on a temporary folder filled once; the device cache is reset before
  each run, so every block is read from its file;
- `transfer`: P/D: a producer computes the prompt (`max_tokens=1`, not timed), then the consumer is timed: it
  pulls the KV over JAX's transfer server, scatters it, and computes the last prompt token.
TTFT is `LLM.generate` of one token. Per-transfer seconds come from the connector's own counters, so the
bandwidths are the copy alone; the machine's memory bandwidth is measured in the same run for comparison.

    python benchmarks/kv_transfer.py --prompt-len 480 --rounds 5 --out benchmarks/results/kv_transfer_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from machine_ceilings import ceilings

from jaxllm import LLM, SamplingParams
from jaxllm.bench.offline import machine_info

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)
BLOCK = 16


def kv_bytes_per_block() -> int:
    return 2 * 30 * BLOCK * 3 * 64 * 4  # the default model in float32: layers, block, KV heads, head dim


def prompts(llm: LLM, n: int, length: int) -> list[dict]:
    """`n` different prompts of exactly `length` tokens."""
    tokenizer = llm.get_tokenizer()
    text = "The history of every great city is a history of water, trade and stubborn people. " * 40
    ids = tokenizer.encode(text)
    return [{"prompt_token_ids": [(t + i) % 40000 + 100 for t in ids[:length]]} for i in range(n)]


def timed(llm: LLM, prompt: dict, params: SamplingParams = ONE_TOKEN) -> float:
    started = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length", out.error
    return time.perf_counter() - started


def hits(stats: dict) -> int:
    """Prompt tokens not computed so far: the device prefix cache's hits and the connector's."""
    return stats["prefix_cache_hits"] + stats.get("external_prefix_cache_hits", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n_blocks = -(-(args.prompt_len + 1) // BLOCK)
    max_model_len = n_blocks * BLOCK
    engine = dict(
        max_model_len=max_model_len,
        max_num_seqs=4,
        max_num_batched_tokens=max_model_len,
        dtype="float32",
        progress=False,
    )
    pool = lambda blocks: blocks * kv_bytes_per_block()  # noqa: E731
    folder = tempfile.mkdtemp(prefix="jaxllm-kv-bench-")
    transfer = {"kv_connector": "TransferConnector"}
    engines = {
        "recompute": LLM(**engine, kv_cache_memory_bytes=pool(4 * n_blocks)),
        "host": LLM(**engine, kv_cache_memory_bytes=pool(n_blocks + 3), kv_offloading_size=0.5),
        "storage": LLM(
            **engine,
            kv_cache_memory_bytes=pool(4 * n_blocks),
            kv_transfer_config={
                "kv_connector": "SharedStorageConnector",
                "kv_connector_extra_config": {"shared_storage_path": folder},
            },
        ),
        "transfer": LLM(
            **engine,
            kv_cache_memory_bytes=pool(4 * n_blocks),
            kv_transfer_config={**transfer, "kv_role": "kv_consumer"},
        ),
    }
    producer = LLM(
        **engine, kv_cache_memory_bytes=pool(4 * n_blocks), kv_transfer_config={**transfer, "kv_role": "kv_producer"}
    )
    prompt, evictor = prompts(engines["recompute"], 2, args.prompt_len)
    remote = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}})

    # warm every path once (and fill the storage folder)
    for llm in engines.values():
        timed(llm, prompt)
    engines["storage"].engine.kv_connector.worker.flush()
    timed(engines["host"], evictor)

    direction = {"host": "load", "storage": "load", "transfer": "receive"}
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    copy_gb_s: dict[str, list[float]] = {name: [] for name in direction}
    cached: dict[str, list[int]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            params = ONE_TOKEN
            if name in ("recompute", "storage", "transfer"):
                llm.engine.reset_prefix_cache()
            if name == "host":
                timed(llm, evictor)  # evicts the prompt's blocks to host memory
            if name == "transfer":
                out = producer.generate([prompt], remote, use_tqdm=False)[0]
                params = SamplingParams(
                    max_tokens=1, temperature=0, extra_args={"kv_transfer_params": out.kv_transfer_params}
                )
            before = llm.engine.stats()  # (also drains the connector's per-transfer seconds so far)
            ttft[name].append(timed(llm, prompt, params))
            after = llm.engine.stats()
            cached[name].append(hits(after) - hits(before))
            if name in direction:
                key = f"kv_transfer_{direction[name]}_bytes"
                seconds = sum(after["kv_transfer_seconds"].get(direction[name], []))
                if seconds > 0:
                    copy_gb_s[name].append((after[key] - before[key]) / seconds / 1e9)

    summary = {}
    base = statistics.median(ttft["recompute"])
    for name, times in ttft.items():
        entry = {
            "ttft_s_median": round(statistics.median(times), 4),
            "ttft_s": [round(t, 4) for t in times],
            "speedup_over_recompute_per_round": [
                round(r / t, 2) for r, t in zip(ttft["recompute"], times, strict=True)
            ],
            "speedup_over_recompute": round(base / statistics.median(times), 2),
            "tokens_not_computed_median": statistics.median(cached[name]),
        }
        if copy_gb_s.get(name):
            entry["copy_gb_s_median"] = round(statistics.median(copy_gb_s[name]), 2)
        summary[name] = entry
    result = {
        "machine": machine_info(),
        "ceilings": {k: v for k, v in ceilings(n=512, reps=5, mem_mib=256).items() if "gb_s" in k},
        "prompt_len": args.prompt_len,
        "kv_bytes_of_prompt": n_blocks * kv_bytes_per_block(),
        "rounds": args.rounds,
        "summary": summary,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    for llm in engines.values():
        if llm.engine.kv_connector is not None:
            llm.engine.kv_connector.worker.close()
    os.system(f"rm -rf {folder}")


if __name__ == "__main__":
    main()

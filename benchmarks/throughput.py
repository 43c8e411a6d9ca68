#!/usr/bin/env python
"""Offline throughput of `LLM.generate` beside the peers, in one run, plus LLM() start-up times.

Workload (the peers' own): B prompts of exactly `--prompt-len` real tokens cut from a fixed
English text (row i starts 7 tokens after row i-1, as ../shared/peers/hf_baseline.py builds
them), greedy, EOS ignored, exactly `--new-tokens` new tokens per row. For each round and
batch size, jaxllm and each peer run back to back; the JSON holds every run, the medians and
the median of the per-round ratios.

    python benchmarks/throughput.py --batches 1 64 --rounds 3 --out benchmarks/results/throughput_cpu.json
    python benchmarks/throughput.py --no-scan-layers --out benchmarks/results/throughput_cpu_unrolled.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

FILLER = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. Knowledge is power, and time waits for no one. "
    "In the middle of difficulty lies opportunity, and the best way out is always through. "
)
HERE = os.path.dirname(os.path.abspath(__file__))


def make_prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    ids = tokenizer(FILLER * (prompt_len // 20 + 8), add_special_tokens=False)["input_ids"]
    while len(ids) < prompt_len + 7 * batch + 1:
        ids = ids + ids
    return [ids[7 * i: 7 * i + prompt_len] for i in range(batch)]


def engine_args(args) -> dict:
    return dict(max_num_seqs=max(args.batches), max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.prompt_len + args.new_tokens + 16, dtype=args.dtype,
                scan_layers=args.scan_layers)


def run_jaxllm(llm, batch: int, args) -> dict:
    from jaxllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in make_prompts(llm.get_tokenizer(), batch, args.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert total == batch * args.new_tokens, total
    return {"engine": "jaxllm", "batch": batch, "wall_s": round(wall, 3), "output_tok_per_s": round(total / wall, 2)}


def run_peer(script: str, batch: int, args) -> dict:
    cmd = [sys.executable, script, "--batch", str(batch), "--prompt-len", str(args.prompt_len),
           "--max-new-tokens", str(args.new_tokens)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        return {"engine": os.path.basename(script), "batch": batch, "error": result.stderr.strip()[-400:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def startup_seconds(args, cache_dir: str) -> dict:
    """LLM() in a fresh process: wall time to a ready engine, and its own breakdown."""
    code = (
        "import json, time; t = time.perf_counter(); from jaxllm import LLM; "
        f"llm = LLM(progress=False, compilation_cache_dir={cache_dir!r}, **{engine_args(args)!r}); "
        "print(json.dumps({'wall_s': round(time.perf_counter() - t, 2), "
        "'compile_s': round(llm.engine.runner.compile_seconds, 2), 'buckets': len(llm.engine.runner.buckets)}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-scan-layers: unrolled layers (faster CPU decode, longer compile)")
    ap.add_argument("--peers-dir", default=os.path.join(HERE, "..", "..", "shared", "peers"))
    ap.add_argument("--peers", nargs="*", default=["hf_baseline.py"])
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax

    from jaxllm import LLM

    report = {"workload": {k: getattr(args, k) for k in ("batches", "prompt_len", "new_tokens", "rounds")},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                          "backend": jax.default_backend()},
              "engine_args": engine_args(args)}
    if not args.skip_startup:
        with tempfile.TemporaryDirectory() as cache:
            report["startup"] = {"cold_cache": startup_seconds(args, cache), "warm_cache": startup_seconds(args, cache)}
        print(json.dumps(report["startup"]), file=sys.stderr)

    llm = LLM(progress=False, **engine_args(args))
    run_jaxllm(llm, 2, argparse.Namespace(**{**vars(args), "new_tokens": 4}))  # warm the host path
    runs = []
    for round_index in range(args.rounds):
        for batch in args.batches:
            row = {"round": round_index, "batch": batch, "jaxllm": run_jaxllm(llm, batch, args)}
            for peer in args.peers:
                row[peer] = run_peer(os.path.join(args.peers_dir, peer), batch, args)
            print(json.dumps(row), file=sys.stderr)
            runs.append(row)
    report["runs"] = runs

    summary = {}
    for batch in args.batches:
        rows = [r for r in runs if r["batch"] == batch]
        entry = {"jaxllm_tok_per_s": statistics.median(r["jaxllm"]["output_tok_per_s"] for r in rows)}
        for peer in args.peers:
            ok = [r for r in rows if "output_tok_per_s" in r[peer]]
            if ok:
                entry[f"{peer}_tok_per_s"] = statistics.median(r[peer]["output_tok_per_s"] for r in ok)
                entry[f"ratio_vs_{peer}"] = round(statistics.median(
                    r["jaxllm"]["output_tok_per_s"] / r[peer]["output_tok_per_s"] for r in ok), 2)
        summary[f"batch_{batch}"] = entry
    report["summary"] = summary
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

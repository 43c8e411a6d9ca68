#!/usr/bin/env python
"""Where a batch's time goes by kind of step: decode steps (one token per sequence) against the steps that carry
prompt tokens (chunked prefill mixed with decodes), for each setting in turn, as the throughput benchmark's run.

`benchmarks/throughput.py` gives one output rate per batch; a ratio between two paths there mixes the prefill's
ratio with the decode's. This times every engine step of the same greedy run (`--batch` prompts of `--input-len`
random token ids, `--output-len` tokens each, EOS ignored) and prints per setting the medians and totals of each
kind, then each kind's ratio to the first setting. A setting is QUANTIZATION[:INT8_DOT], each run in a process of
its own: `native` (the model's own quantization) or a `--quantization` name, and `JAXLLM_CPU_INT8_DOT` (default
off).

    python benchmarks/step_phases.py --settings native:auto native:off none --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_setting(args: argparse.Namespace, setting: str) -> dict:
    """One setting in this process (its environment is set before JAX starts)."""
    import numpy as np

    from jaxllm import LLM, SamplingParams

    quantization = setting.split(":")[0]
    llm = LLM(
        model=args.model,
        progress=False,
        max_num_seqs=args.batch,
        max_model_len=args.input_len + args.output_len,
        quantization=None if quantization == "native" else quantization,
    )
    loop = llm.engine.loop
    steps: list[tuple[str, float]] = []
    launch = loop.step

    def timed_step():
        start = time.perf_counter()
        out, outputs = launch()
        tokens = sum(s.num_new_tokens for s in out.scheduled)
        kind = "decode" if tokens == len(out.scheduled) else "with_prompt"
        if out.scheduled:
            steps.append((kind, time.perf_counter() - start))
        return out, outputs

    loop.step = timed_step
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, args.input_len).tolist()} for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    rounds = []
    for _ in range(args.rounds):
        steps.clear()
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rate = args.batch * args.output_len / elapsed
        row = {"elapsed_s": round(elapsed, 3), "output_tokens_per_second": round(rate, 1)}
        for kind in ("decode", "with_prompt"):
            times = [t for k, t in steps if k == kind]
            row[kind] = {
                "steps": len(times),
                "median_ms": round(1e3 * statistics.median(times), 2) if times else None,
                "total_s": round(sum(times), 3),
            }
        rounds.append(row)
    from jaxllm.bench.offline import cpu_kernel_info

    return {"setting": setting, "cpu_kernels": cpu_kernel_info(llm), "rounds": rounds}


def median_of(rounds: list[dict], kind: str, key: str) -> float | None:
    values = [r[kind][key] for r in rounds if r[kind][key] is not None]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--settings", nargs="+", default=["native:auto", "none"], help="QUANTIZATION[:INT8_DOT]")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run this setting, print its JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_setting(args, args.one)))
        return
    results = []
    for setting in args.settings:  # a process each: the CPU kernels' choices are made once per process
        int8_dot = setting.split(":")[1] if ":" in setting else "off"
        env = {**os.environ, "JAXLLM_CPU_INT8_DOT": int8_dot}
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", setting]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        for kind in ("decode", "with_prompt"):
            result[kind] = {key: median_of(result["rounds"], kind, key) for key in ("median_ms", "total_s")}
        results.append(result)
        print(json.dumps({k: result[k] for k in ("setting", "decode", "with_prompt")}), flush=True)
    base = results[0]
    for result in results[1:]:
        result["ratio_to_first"] = {
            kind: round(result[kind]["median_ms"] / base[kind]["median_ms"], 2)
            for kind in ("decode", "with_prompt")
            if result[kind]["median_ms"] and base[kind]["median_ms"]
        }
    from jaxllm.bench.offline import machine_info, write_json

    report = {"machine": machine_info(), "workload": vars(args), "results": results}
    report["workload"].pop("one")
    print(json.dumps(report, indent=1))
    write_json(report, args.output_json)


if __name__ == "__main__":
    main()

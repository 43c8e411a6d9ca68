#!/usr/bin/env python
"""Start-up time of `jaxllm generate "Hello"`: cold (empty compilation caches) and warm, phase by phase.

Each start runs in a fresh subprocess doing what `jaxllm generate` does (parse the CLI flags,
build the `LLM`, chat-template the prompt, generate `--max-tokens` greedy tokens, print), with
its compilation cache folder (`--compilation-cache-dir`: JAX's persistent cache and jaxllm's
compiled steps) and jaxllm's cache folder (`JAXLLM_CACHE`: the converted GGUF tokenizer) set
to folders of this script's:
- `cold`: new empty folders each round (the weights are on disk, and the C++ kernels' one-time
  build is copied in from the user's `$JAXLLM_CACHE/kernels`: a new machine pays it once);
- `warm`: the folders a first, unreported start filled.
Cold and warm rounds alternate, so a load spike on a shared machine hits both alike.

Per start it reports `wall_s` (spawn to exit, what a user waits), `ready_s` (spawn to
the engine ready, before the first token), `cpu_s` (CPU seconds of all threads up to ready:
on a shared machine, `cpu_s / cores` is the better guess of a quiet start), the interpreter
and import time, the engine's phases (`EngineCore.startup_phases`: weights, packed for the CPU
kernel, and tokenizer, in a thread while kv_cache, step_key and buckets run; waiting_for_weights;
prepare_weights, what the runner still rearranges), and `generate_s`; then the median of each over the rounds, and the load average. Prints JSON;
`--output` also writes it.

    python benchmarks/startup.py --rounds 3 --output benchmarks/results/startup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = "--child"


def child(cache_dir: str, spawned: float, max_tokens: int, engine_flags: list[str]) -> None:
    """One start, as `jaxllm generate Hello` runs it; prints one JSON line of timings."""
    entered = time.time()
    from jaxllm.entrypoints.cli import build_parser
    from jaxllm.entrypoints.cli.common import make_llm, sampling_params

    imported = time.time()
    args = build_parser().parse_args(["generate", "Hello", "--max-tokens", str(max_tokens),
                                      "--compilation-cache-dir", cache_dir, *engine_flags])
    llm = make_llm(args)
    ready = time.time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    outputs = llm.chat([[{"role": "user", "content": "Hello"}]], sampling_params(args), use_tqdm=False)
    done = time.time()
    engine = llm.engine
    print(json.dumps({
        "interpreter_s": entered - spawned, "imports_s": imported - entered, "ready_s": ready - spawned,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # CPU seconds to ready, all threads: less swayed by load
        "generate_s": done - ready,  # older trees (A/B runs) lack the phases
        "phases": getattr(engine, "startup_phases", {"total": engine.startup_seconds}),
        "num_buckets": len(engine.runner.buckets),  # older trees (A/B runs) count loaded buckets, not executables
        "executables_loaded": getattr(engine.runner, "loaded_executables", getattr(engine.runner, "loaded_buckets", 0)),
        "num_executables": getattr(engine.runner, "num_executables", len(engine.runner.buckets)),
        "kv_blocks": engine.runner.num_blocks,
        "tokens": len(outputs[0].outputs[0].token_ids), "text": outputs[0].outputs[0].text,
    }))


def start(cache_dir: str, max_tokens: int, engine_flags: list[str]) -> dict:
    """One start whose caches all live under `cache_dir` (the built C++ kernels copied in)."""
    from pallas_kernels.cpu_ffi import _cache_dir as kernel_dir

    env = {**os.environ, "JAXLLM_CACHE": os.path.join(cache_dir, "jaxllm")}
    if kernel_dir().is_dir():
        shutil.copytree(kernel_dir(), os.path.join(cache_dir, "jaxllm", "kernels"), dirs_exist_ok=True)
    spawned = time.time()
    cmd = [sys.executable, __file__, CHILD, os.path.join(cache_dir, "xla"), repr(spawned), str(max_tokens),
           *engine_flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - spawned
    if done.returncode:
        raise RuntimeError(f"start-up run failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **result}


def medians(runs: list[dict]) -> dict:
    keys = ("wall_s", "ready_s", "cpu_s", "interpreter_s", "imports_s", "generate_s")
    summary = {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
    summary["phases"] = {k: round(statistics.median(r["phases"][k] for r in runs), 2) for k in runs[0]["phases"]}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("engine_flags", nargs="*", help="extra `jaxllm generate` flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as root:
        warm_dir = os.path.join(root, "warm")
        start(warm_dir, args.max_tokens, args.engine_flags)  # fills the warm folder
        cold, warm, loads = [], [], []
        for i in range(args.rounds):
            loads.append(os.getloadavg()[0])
            cold.append(start(os.path.join(root, f"cold{i}"), args.max_tokens, args.engine_flags))
            warm.append(start(warm_dir, args.max_tokens, args.engine_flags))
            print(f"round {i}: cold {cold[-1]['wall_s']:.1f}s, warm {warm[-1]['wall_s']:.1f}s "
                  f"(load {loads[-1]:.1f})", file=sys.stderr)
    result = {
        "command": "jaxllm generate Hello --max-tokens %d %s" % (args.max_tokens, " ".join(args.engine_flags)),
        "rounds": args.rounds, "cpu_count": os.cpu_count(), "load_average_at_round_start": loads,
        "cold": medians(cold), "warm": medians(warm), "cold_runs": cold, "warm_runs": warm,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    else:
        main()

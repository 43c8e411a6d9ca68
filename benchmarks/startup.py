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
prepare_weights, what the runner still rearranges), and `generate_s`; then the median of each
over the rounds, and the load average. Prints JSON; `--output` also writes it.

`--weights-only` times the reading thread's work alone instead (no compiles beside it):
`ModelSource.load` of the default model with the step's weight layout, `load_s` and `cpu_s`
of the load and its phases (weights, tokenizer). `--pause` idles before each cold round: on
a VM, memory left idle is reclaimed and slow to touch again, as it is between two real starts.

    python benchmarks/startup.py --rounds 3 --output benchmarks/results/startup_cpu.json
    python benchmarks/startup.py --weights-only --pause 20 --rounds 2 --output benchmarks/results/weights_load_cpu.json
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

CHILD, WEIGHTS_CHILD = "--child", "--weights-child"
START_KEYS = ("wall_s", "ready_s", "cpu_s", "interpreter_s", "imports_s", "generate_s")
WEIGHTS_KEYS = ("wall_s", "load_s", "cpu_s")


def child(cache_dir: str, spawned: float, max_tokens: int, engine_flags: list[str]) -> None:
    """One start, as `jaxllm generate Hello` runs it; prints one JSON line of timings."""
    entered = time.time()
    from jaxllm.entrypoints.cli import build_parser
    from jaxllm.entrypoints.cli.common import make_llm, sampling_params

    imported = time.time()
    args = build_parser().parse_args(
        ["generate", "Hello", "--max-tokens", str(max_tokens), "--compilation-cache-dir", cache_dir, *engine_flags]
    )
    llm = make_llm(args)
    ready = time.time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    outputs = llm.chat([[{"role": "user", "content": "Hello"}]], sampling_params(args), use_tqdm=False)
    done = time.time()
    engine = llm.engine
    print(
        json.dumps(
            {
                "interpreter_s": entered - spawned,
                "imports_s": imported - entered,
                "ready_s": ready - spawned,
                "cpu_s": usage.ru_utime + usage.ru_stime,  # CPU seconds to ready, all threads: less swayed by load
                "generate_s": done - ready,  # older trees (A/B runs) lack the phases
                "phases": getattr(engine, "startup_phases", {"total": engine.startup_seconds}),
                "num_buckets": len(
                    engine.runner.buckets
                ),  # older trees (A/B runs) count loaded buckets, not executables
                "executables_loaded": getattr(
                    engine.runner, "loaded_executables", getattr(engine.runner, "loaded_buckets", 0)
                ),
                "num_executables": getattr(engine.runner, "num_executables", len(engine.runner.buckets)),
                "kv_blocks": engine.runner.num_blocks,
                "tokens": len(outputs[0].outputs[0].token_ids),
                "text": outputs[0].outputs[0].text,
            }
        )
    )


def weights_child() -> None:
    """One load of the default model's weights, as an engine's reading thread does it; prints one JSON line."""
    import jax

    from jaxllm.engine.args import EngineArgs
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.runner.cpu_kernels import weight_layout
    from jaxllm.weights import converted, open_model

    mesh = make_mesh()
    source = open_model(None)
    config = EngineArgs().create_engine_config(source.arch.max_position_embeddings, jax.default_backend())
    layout = weight_layout(source.arch, config, source.dtype, mesh, source.quant)
    started, cpu = time.perf_counter(), time.process_time()
    loaded = source.load(mesh, None, 0, layout)
    load, cpu = time.perf_counter() - started, time.process_time() - cpu
    converted.wait_for_saves()  # the kept folder complete before the next load (not timed: beside a start)
    print(json.dumps({"load_s": load, "cpu_s": cpu, "phases": loaded.load_seconds}))


def start(cache_dir: str, max_tokens: int, engine_flags: list[str], weights_only: bool = False) -> dict:
    """One start (or, `weights_only`, one weights load) whose caches all live under `cache_dir` (the built C++
    kernels copied in)."""
    from pallas_kernels.cpu_ffi import _cache_dir as kernel_dir

    env = {**os.environ, "JAXLLM_CACHE": os.path.join(cache_dir, "jaxllm")}
    if kernel_dir().is_dir():
        shutil.copytree(kernel_dir(), os.path.join(cache_dir, "jaxllm", "kernels"), dirs_exist_ok=True)
    spawned = time.time()
    cmd = (
        [sys.executable, __file__, WEIGHTS_CHILD]
        if weights_only
        else [
            sys.executable,
            __file__,
            CHILD,
            os.path.join(cache_dir, "xla"),
            repr(spawned),
            str(max_tokens),
            *engine_flags,
        ]
    )
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - spawned
    if done.returncode:
        raise RuntimeError(f"start-up run failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **result}


def medians(runs: list[dict], keys: tuple[str, ...]) -> dict:
    summary = {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
    summary["phases"] = {k: round(statistics.median(r["phases"][k] for r in runs), 2) for k in runs[0]["phases"]}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--weights-only", action="store_true", help="time loading the weights alone")
    parser.add_argument("--pause", type=float, default=0.0, help="idle seconds before each cold round")
    parser.add_argument("engine_flags", nargs="*", help="extra `jaxllm generate` flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as root:
        warm_dir = os.path.join(root, "warm")
        run = lambda folder: start(folder, args.max_tokens, args.engine_flags, args.weights_only)  # noqa: E731
        run(warm_dir)  # fills the warm folder
        cold, warm, loads = [], [], []
        for i in range(args.rounds):
            time.sleep(args.pause)
            loads.append(os.getloadavg()[0])
            cold.append(run(os.path.join(root, f"cold{i}")))
            warm.append(run(warm_dir))
            print(
                f"round {i}: cold {cold[-1]['wall_s']:.1f}s, warm {warm[-1]['wall_s']:.1f}s (load {loads[-1]:.1f})",
                file=sys.stderr,
            )
    keys = WEIGHTS_KEYS if args.weights_only else START_KEYS
    command = (
        "ModelSource.load of the default model"
        if args.weights_only
        else f"jaxllm generate Hello --max-tokens {args.max_tokens} {' '.join(args.engine_flags)}"
    )
    result = {
        "command": command,
        "rounds": args.rounds,
        "pause_s": args.pause,
        "cpu_count": os.cpu_count(),
        "load_average_at_round_start": loads,
        "cold": medians(cold, keys),
        "warm": medians(warm, keys),
        "cold_runs": cold,
        "warm_runs": warm,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    elif sys.argv[1:2] == [WEIGHTS_CHILD]:
        weights_child()
    else:
        main()

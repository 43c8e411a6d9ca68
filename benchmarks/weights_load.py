#!/usr/bin/env python
"""Loading the default model's weights alone, as an engine's loading thread does (no compiles beside it).

Each load runs in a fresh subprocess: `open_model`, then `ModelSource.load` with the step's
weight layout (packed for the CPU kernel), under a `JAXLLM_CACHE` of this script's:
- `cold`: a new empty cache folder (the GGUF is dequantized, laid out and kept on disk);
- `warm`: the folder the first load of the run filled (the kept arrays are mapped).
Cold and warm alternate, so a load spike hits both alike; an idle pause before each cold load
lets the machine reclaim freed memory, as between two starts (on a VM, fresh memory is slow
to touch: part of what a cold start pays). Reports wall and CPU seconds of the load and
the phases (`weights`, `tokenizer`), with medians, as JSON (`--output` also writes it).

    python benchmarks/weights_load.py --rounds 3 --output benchmarks/results/weights_load_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = "--child"


def child() -> None:
    import jax

    from jaxllm.engine.args import EngineArgs
    from jaxllm.parallel.mesh import make_mesh
    from jaxllm.runner.model_runner import weight_layout
    from jaxllm.weights import converted, open_model

    mesh = make_mesh()
    source = open_model(None)
    config = EngineArgs().create_engine_config(source.arch.max_position_embeddings, jax.default_backend())
    layout = weight_layout(source.arch, config, source.dtype, mesh)
    started, cpu = time.perf_counter(), time.process_time()
    loaded = source.load(mesh, None, 0, layout)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    converted.wait_for_saves()  # the kept folder complete before the next load (not timed: beside the start)
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, **loaded.load_seconds}))


def load(cache: str) -> dict:
    done = subprocess.run([sys.executable, __file__, CHILD], capture_output=True, text=True,
                          env={**os.environ, "JAXLLM_CACHE": cache})
    if done.returncode:
        raise RuntimeError(f"load failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pause", type=float, default=20.0, help="idle seconds before each cold load")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxllm-weights-") as root:
        from pallas_kernels.cpu_ffi import _cache_dir as kernel_dir  # the C++ kernels' one-time build

        def fresh(name: str) -> str:
            path = os.path.join(root, name)
            if kernel_dir().is_dir():
                shutil.copytree(kernel_dir(), os.path.join(path, "kernels"))
            return path

        warm_dir = fresh("warm")
        load(warm_dir)
        cold, warm, loads = [], [], []
        for i in range(args.rounds):
            time.sleep(args.pause)
            loads.append(os.getloadavg()[0])
            cold.append(load(fresh(f"cold{i}")))
            warm.append(load(warm_dir))
            print(f"round {i}: cold {cold[-1]['wall_s']:.2f}s, warm {warm[-1]['wall_s']:.2f}s "
                  f"(load {loads[-1]:.1f})", file=sys.stderr)
    result = {"rounds": args.rounds, "cpu_count": os.cpu_count(), "load_average_at_round_start": loads,
              "cold": medians(cold), "warm": medians(warm), "cold_runs": cold, "warm_runs": warm}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        child()
    else:
        main()

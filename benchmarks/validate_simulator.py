"""Simulated vs real, on three traces: light load, overload with preemption, shared prefixes.

For each trace, `jaxllm simulate` (the cost model from `jaxllm calibrate`) and a real run with
the same engine settings and output lengths forced (min_tokens = max_tokens, EOS ignored):

- `--real server` (default): `jaxllm serve` as a child process and `jaxllm bench serve
  --dataset-name jsonl` against it — the full serving path (HTTP, streaming, detokenization).
- `--real engine`: the offline `EngineCore`, requests added in real time as they arrive
  (`jaxllm.sim.engine_run`) — no HTTP; a cheaper stand-in, labelled as such in the table.

Writes a Markdown table (makespan, mean TTFT, mean TPOT: simulated, real, error) and the raw
numbers as JSON. Usage:

    jaxllm calibrate --out cost.json --kv-cache-memory-bytes 188743680 --dtype float32
    python benchmarks/validate_simulator.py --cost cost.json --real server --out benchmarks/results/validate_simulator
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxllm.sim.calibrate import engine_args_for, sim_config_for
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.simulator import cost_model_step_time, simulate
from jaxllm.sim.synth import LengthDist, synthesize
from jaxllm.sim.trace import save_trace

METRICS = (("makespan (s)", "duration", 1.0), ("mean TTFT (ms)", "mean_ttft_ms", 1.0),
           ("mean TPOT (ms)", "mean_tpot_ms", 1.0))


def traces(max_model_len: int) -> dict[str, list]:
    """Sized for the calibration shapes (8 sequences, 64-token steps, 512-token context) and a 128-block
    pool on a CPU: the overload trace's 8 running sequences need ~175 blocks, so some are preempted."""
    return {
        "light": synthesize(16, request_rate=0.5, input_len=LengthDist(48, "uniform"),
                            output_len=LengthDist(24, "uniform"), seed=1),
        "overload + preemption": synthesize(20, request_rate=float("inf"),
                                            input_len=LengthDist(min(200, max_model_len // 3), "uniform", range_ratio=0.2),
                                            output_len=LengthDist(min(150, max_model_len // 4), "uniform", range_ratio=0.2),
                                            seed=2),
        "shared prefix": synthesize(24, request_rate=3, input_len=LengthDist(24, "uniform"),
                                    output_len=LengthDist(20, "uniform"), num_prefix_groups=3, prefix_len=192, seed=3),
    }


def engine_flags(engine: dict) -> list[str]:
    return engine_args_for(engine).to_cli_args()


def real_server(trace_paths: dict[str, Path], engine: dict, workdir: Path, rounds: int) -> dict[str, dict]:
    """Per trace, the median over `rounds` runs of each metric (one run's TTFT on a busy trace can swing 2x
    on a shared machine), each on a fresh server (an empty prefix cache, as simulated)."""
    from jaxllm.bench.server_process import ServerProcess

    results = {}
    for name, path in trace_paths.items():
        runs = []
        for round_ in range(rounds):
            with ServerProcess(engine_flags(engine), log_path=workdir / f"{path.stem}.{round_}.server.log") as server:
                out = workdir / f"{path.stem}.{round_}.bench.json"
                subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", "bench", "serve", "--base-url",
                                server.url, "--dataset-name", "jsonl", "--dataset-path", str(path), "--output",
                                str(out), "--disable-tqdm"], check=True)
                run = json.loads(out.read_text())
                run["num_preemptions"] = server.metrics().get("jaxllm:num_preemptions_total", 0.0)
                runs.append(run)
        results[name] = {key: statistics.median(r[key] for r in runs)
                         for key in ("duration", "mean_ttft_ms", "mean_tpot_ms", "num_preemptions")}
        results[name]["rounds"] = {key: [r[key] for r in runs] for key in ("duration", "mean_ttft_ms", "mean_tpot_ms")}
    return results


def real_engine(trace_sets: dict[str, list], engine: dict) -> dict[str, dict]:
    from jaxllm.bench.results import summarize
    from jaxllm.engine.core import EngineCore
    from jaxllm.sim.engine_run import run_trace_on_engine

    core = EngineCore(engine_args_for(engine), progress=False)
    results = {}
    for name, trace in trace_sets.items():
        core.kv.reset_prefix_cache()  # an empty prefix cache, as simulated
        before = core.scheduler.num_preemptions
        run = run_trace_on_engine(core, trace)
        results[name] = {**summarize(run.records, run.duration),
                         "num_preemptions": core.scheduler.num_preemptions - before}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost", required=True, help="cost model from `jaxllm calibrate`")
    parser.add_argument("--real", choices=("server", "engine"), default="server")
    parser.add_argument("--num-blocks", type=int, default=128, help="KV pool (blocks) of both runs")
    parser.add_argument("--rounds", type=int, default=3, help="real server runs per trace (medians are compared)")
    parser.add_argument("--out", default="benchmarks/results/validate_simulator", help="writes OUT.md and OUT.json")
    args = parser.parse_args()

    cost = CostModel.load(args.cost)
    engine = {**cost.engine, "num_blocks": args.num_blocks}
    config = sim_config_for(engine)
    trace_sets = traces(engine["max_model_len"])
    # the front end's per-request latency exists only there; an idle engine waking up in both
    events = cost.event_costs() if args.real == "server" else {**cost.event_costs(), "request_latency_s": 0.0}
    simulated = {name: simulate(trace, config, cost_model_step_time(cost, config), **events).to_json()
                 for name, trace in trace_sets.items()}
    workdir = Path(tempfile.mkdtemp(prefix="validate-sim-"))
    paths = {}
    for i, (name, trace) in enumerate(trace_sets.items()):
        paths[name] = workdir / f"trace{i}.jsonl"
        save_trace(trace, paths[name])
    real = real_server(paths, engine, workdir, args.rounds) if args.real == "server" else real_engine(trace_sets, engine)

    label = (f"jaxllm serve + bench serve, median of {args.rounds} runs" if args.real == "server"
             else "offline EngineCore, real-time arrivals")
    lines = [f"Simulated vs real ({label}); cost model {os.path.basename(args.cost)} "
             f"(device fit mean error {cost.fit['mean_abs_rel_error']:.0%}), load average "
             f"{os.getloadavg()[0]:.1f} at the end.", "",
             "| trace | metric | simulated | real | error |", "|---|---|---:|---:|---:|"]
    rows = {}
    for name in trace_sets:
        for label_, key, _ in METRICS:
            s, r = simulated[name][key], real[name][key]
            err = (s - r) / r if r else float("nan")
            rows.setdefault(name, {})[key] = {"simulated": s, "real": r, "error": err}
            lines.append(f"| {name} | {label_} | {s:.1f} | {r:.1f} | {err:+.1%} |")
        rows[name]["num_preemptions"] = {"simulated": simulated[name]["num_preemptions"],
                                         "real": real[name].get("num_preemptions")}
        pre = rows[name]["num_preemptions"]
        lines.append(f"| {name} | preemptions | {pre['simulated']} | {pre['real']:g} | |")
        rows[name]["real_rounds"] = real[name].get("rounds")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps({"real": args.real, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

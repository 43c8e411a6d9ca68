"""Simulated vs real, on three traces: light load, overload with preemption, shared prefixes.

For each trace, `jaxllm simulate` (a cost model from `jaxllm calibrate`) and a real run with
the same engine settings and output lengths forced (min_tokens = max_tokens, EOS ignored):

- `--real server` (default): `jaxllm serve` as a child process and `jaxllm bench serve
  --dataset-name jsonl` against it — the full serving path (HTTP, streaming, detokenization),
  a fresh server per run (an empty prefix cache, as simulated).
- `--real engine`: the offline `EngineCore`, requests added in real time as they arrive
  (`jaxllm.sim.engine_run`) — no HTTP; a cheaper stand-in, labelled as such in the table.

**Paired rounds.** By default each round first calibrates (`jaxllm calibrate` in a child
process, the engine below), then runs every trace once for real and simulates it with that
round's cost model. A shared VM's speed drifts by more than the 10 % being checked within
minutes (measured: one decode step 15.3 ms, then 20.1 ms two minutes later), so a prediction
is only comparable with a measurement taken in the same minutes. The table compares the median
over rounds of the simulated figures with the median of the real ones, and lists each round's
paired error. `--cost FILE` instead uses one given model for every round.

Writes a Markdown table and the raw numbers as JSON. Usage:

    python benchmarks/validate_simulator.py --rounds 5 --out benchmarks/results/validate_simulator
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx

from jaxllm.sim.calibrate import engine_args_for, sim_config_for
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.simulator import cost_model_step_time, simulate
from jaxllm.sim.synth import LengthDist, synthesize
from jaxllm.sim.trace import save_trace

METRICS = (("makespan (s)", "duration"), ("mean TTFT (ms)", "mean_ttft_ms"), ("mean TPOT (ms)", "mean_tpot_ms"))
# the calibrated engine: the test suite's shapes (calibrate's defaults until issue 44; now serve's, so written out)
# in float32 with a 256-block pool of the default model (room for the sweep's longest contexts); the traces then
# run in --num-blocks
CALIBRATION_FLAGS = [
    *("--dtype", "float32", "--kv-cache-memory-bytes", str(256 * 737280)),
    *("--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"),
]


def traces(max_model_len: int) -> dict[str, list]:
    """Sized for the calibration shapes (8 sequences, 64-token steps, 512-token context) and a 128-block
    pool on a CPU: the overload trace's 8 running sequences need ~175 blocks, so some are preempted.

    The overload burst sends its requests 10 ms apart, not at one instant: requests sent together
    reach the server in any order (seen: the 16th first), and fcfs then preempts other requests than
    the simulation, which keeps the trace's order (6 preemptions against 4)."""
    burst = synthesize(
        20,
        request_rate=float("inf"),
        input_len=LengthDist(min(200, max_model_len // 3), "uniform", range_ratio=0.2),
        output_len=LengthDist(min(150, max_model_len // 4), "uniform", range_ratio=0.2),
        seed=2,
    )
    return {
        "light": synthesize(
            16, request_rate=0.5, input_len=LengthDist(48, "uniform"), output_len=LengthDist(24, "uniform"), seed=1
        ),
        "overload + preemption": [replace(r, arrival_time=0.01 * i) for i, r in enumerate(burst)],
        "shared prefix": synthesize(
            24,
            request_rate=3,
            input_len=LengthDist(24, "uniform"),
            output_len=LengthDist(20, "uniform"),
            num_prefix_groups=3,
            prefix_len=192,
            seed=3,
        ),
    }


def calibrate_now(out: Path, server: bool) -> CostModel:
    """`jaxllm calibrate` in a child process (its engine is gone before the real runs start)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxllm.entrypoints.cli",
            "calibrate",
            "--out",
            str(out),
            "--server" if server else "--no-server",
            *CALIBRATION_FLAGS,
        ],
        check=True,
    )
    return CostModel.load(out)


def run_on_server(path: Path, engine: dict, workdir: Path, tag: str) -> dict:
    """One run of a trace file on a fresh `jaxllm serve`, replayed by `jaxllm bench serve`.

    One request outside the trace warms the server first: a fresh server's first request runs
    16-47 ms slower (measured, the light trace's first TTFT over five runs), a start-up transient
    that the simulator, modelling a server in service, leaves out. Its prompt shares no block with
    the trace's, so the prefix cache still starts without a hit."""
    from jaxllm.bench.serve import first_model
    from jaxllm.bench.server_process import ServerProcess

    with ServerProcess(engine_args_for(engine).to_cli_args(), log_path=workdir / f"{tag}.server.log") as server:
        httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"model": first_model(server.url, {}), "prompt": list(range(100, 148)), "max_tokens": 4},
        ).raise_for_status()
        out = workdir / f"{tag}.bench.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxllm.entrypoints.cli",
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--dataset-name",
                "jsonl",
                "--dataset-path",
                str(path),
                "--output",
                str(out),
                "--disable-tqdm",
            ],
            check=True,
        )
        return {
            **json.loads(out.read_text()),
            "num_preemptions": server.metrics().get("jaxllm:num_preemptions_total", 0.0),
        }


class EngineRunner:
    """One offline `EngineCore` for every round (`--real engine`), built for the first round's engine."""

    def __init__(self):
        self.core = None

    def __call__(self, trace: list, engine: dict) -> dict:
        from jaxllm.bench.results import summarize
        from jaxllm.engine.core import EngineCore
        from jaxllm.sim.engine_run import run_trace_on_engine

        if self.core is None:
            self.core = EngineCore(engine_args_for(engine), progress=False)
        before = self.core.scheduler.num_preemptions
        run = run_trace_on_engine(self.core, trace)
        return {**summarize(run.records, run.duration), "num_preemptions": self.core.scheduler.num_preemptions - before}


def table(rounds: list[dict], label: str) -> tuple[str, dict]:
    """Median simulated vs median real per trace and metric, and each round's paired error."""
    lines = [
        "| trace | metric | simulated | real | error | paired errors, round by round |",
        "|---|---|---:|---:|---:|---|",
    ]
    rows = {}
    for name in rounds[0]["simulated"]:
        for label_, key in METRICS:
            sims = [r["simulated"][name][key] for r in rounds]
            reals = [r["real"][name][key] for r in rounds]
            s, r = statistics.median(sims), statistics.median(reals)
            paired = [a / b - 1 for a, b in zip(sims, reals, strict=True)]
            rows.setdefault(name, {})[key] = {
                "simulated": s,
                "real": r,
                "error": s / r - 1,
                "simulated_rounds": sims,
                "real_rounds": reals,
                "paired_errors": paired,
            }
            lines.append(
                f"| {name} | {label_} | {s:.1f} | {r:.1f} | {s / r - 1:+.1%} | "
                f"{' / '.join(f'{e:+.0%}' for e in paired)} |"
            )
        pre = {side: [r[side][name]["num_preemptions"] for r in rounds] for side in ("simulated", "real")}
        rows[name]["num_preemptions"] = pre
        lines.append(
            f"| {name} | preemptions | {'/'.join(f'{p:g}' for p in pre['simulated'])} | "
            f"{'/'.join(f'{p:g}' for p in pre['real'])} | | |"
        )
    return f"Simulated vs real ({label}).\n\n" + "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost", default=None, help="one cost model for every round (default: calibrate before each)")
    parser.add_argument("--real", choices=("server", "engine"), default="server")
    parser.add_argument("--num-blocks", type=int, default=128, help="KV pool (blocks) of both runs")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds: calibrate, then each trace once (real and simulated)"
    )
    parser.add_argument("--out", default="benchmarks/results/validate_simulator", help="writes OUT.md and OUT.json")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="validate-sim-"))
    run_on_engine = EngineRunner()
    rounds = []
    for round_ in range(args.rounds):
        cost = (
            CostModel.load(args.cost)
            if args.cost
            else calibrate_now(workdir / f"cost.{round_}.json", server=args.real == "server")
        )
        engine = {**cost.engine, "num_blocks": args.num_blocks}
        config = sim_config_for(engine)
        trace_sets = traces(engine["max_model_len"])
        # the front end's per-request latency exists only there; an idle engine waking up in both
        events = cost.event_costs() if args.real == "server" else {**cost.event_costs(), "request_latency_s": 0.0}
        simulated, real = {}, {}
        for i, (name, trace) in enumerate(trace_sets.items()):
            simulated[name] = simulate(trace, config, cost_model_step_time(cost, config), **events).to_json()
            if args.real == "server":
                save_trace(trace, path := workdir / f"trace{i}.jsonl")
                real[name] = run_on_server(path, engine, workdir, f"trace{i}.{round_}")
            else:
                real[name] = run_on_engine(trace, engine)
        rounds.append({"cost_fit": cost.fit, "load_average": os.getloadavg()[0], "simulated": simulated, "real": real})
        print(f"round {round_ + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)

    where = "jaxllm serve + bench serve" if args.real == "server" else "offline EngineCore, real-time arrivals"
    models = f"the cost model {os.path.basename(args.cost)}" if args.cost else "a fresh calibration each round"
    text, rows = table(
        rounds,
        f"{where}; medians of {args.rounds} rounds, {models}; load average "
        f"{min(r['load_average'] for r in rounds):.1f}–{max(r['load_average'] for r in rounds):.1f} "
        f"at the rounds' ends",
    )
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    keep = ("duration", "mean_ttft_ms", "mean_tpot_ms", "num_preemptions")
    raw = [
        {
            **r,
            "simulated": {n: {k: v[k] for k in keep} for n, v in r["simulated"].items()},
            "real": {n: {k: v[k] for k in keep} for n, v in r["real"].items()},
        }
        for r in rounds
    ]
    out.with_suffix(".json").write_text(
        json.dumps({"real": args.real, "cost": args.cost, "rows": rows, "rounds": raw}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()

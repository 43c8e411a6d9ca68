#!/usr/bin/env python
"""`jaxllm tune`'s choice against the defaults on a held-back trace, in paired, alternated rounds.

A trace from `jaxllm trace synth` is split in two: `jaxllm tune` searches on the first part (the simulator and the
cost model only), and the second part, held back, is served for real by the chosen setting and by the defaults
(`jaxllm serve`'s own values for every argument tune searched; dtype, max_model_len and the KV pool as tuned, so
only the searched arguments differ). Both servers start once and stay up (an idle engine blocks on its command
queue); each round replays the held-back trace on each with `jaxllm bench serve`'s client, the order alternating
(chosen first in even rounds), with the round's own seed for the made-up prompt tokens (no prefix-cache hits from
an earlier round). Reported: per round and as medians, goodput (requests within every SLO per second, and the
fraction), mean and p99 TTFT and TPOT of each, the per-round ratios chosen / default, and the chosen setting's
prediction on the held-back trace beside its measurement. The defaults are not predicted where they lie beyond the
shapes the cost model was calibrated at (that would be extrapolation).

    python benchmarks/tune_report.py --rounds 3 --output benchmarks/results/tune_report_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from jaxllm.bench.server_process import ServerProcess
from jaxllm.engine.args import EngineArgs
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.trace import load_trace, save_trace
from jaxllm.tune.capacity import Objective
from jaxllm.tune.space import SEARCHABLE, SPECULATION
from jaxllm.tune.validate import replay

ROOT = Path(__file__).resolve().parents[1]
COST = ROOT / "examples" / "research" / "cost_cpu.json"
KEYS = ("goodput_fraction", "request_goodput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
RATIOS = ("request_goodput", "mean_ttft_ms", "mean_tpot_ms")  # chosen / default per round


def cli(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", *argv], check=True)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def default_args(best: EngineArgs, searched: list[str]) -> EngineArgs:
    """The tuned arguments with every searched one back at EngineArgs' default (`jaxllm serve` without its flag)."""
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    updates = {name: fields[name] for name in searched if name in fields}
    if SPECULATION in searched:
        updates["speculative_config"] = None
    return dataclasses.replace(best, **updates)


def covered(args: EngineArgs, cost: CostModel) -> bool:
    """Whether the cost model was calibrated at shapes that hold this engine's (else its prediction extrapolates)."""
    engine = cost.engine
    seqs, tokens = args.max_num_seqs, args.max_num_batched_tokens
    return (
        seqs is not None
        and tokens is not None
        and seqs <= engine.get("max_num_seqs", 0)
        and tokens <= min(max(cost.bucket_tokens), engine.get("max_num_batched_tokens", tokens))
    )


def summarize(rounds: list[dict], names: list[str]) -> tuple[dict, dict]:
    """Medians over rounds per setting (measured, predicted, the relative error of the medians), and the per-round
    ratios chosen / default with their median over the rounds where the default's figure is not 0 (`undefined`:
    how many it is)."""

    def median(name: str, kind: str, key: str) -> float | None:
        values = [r[name][kind][key] for r in rounds if kind in r[name]]
        return statistics.median(values) if values else None

    medians: dict = {
        name: {kind: {key: median(name, kind, key) for key in KEYS} for kind in ("measured", "predicted")}
        for name in names
    }
    for name in names:
        m, p = medians[name]["measured"], medians[name]["predicted"]
        medians[name]["relative_error"] = {
            key: (p[key] - m[key]) / m[key] if p[key] is not None and m[key] else None for key in KEYS
        }
    ratios = {}
    for key in RATIOS:
        per_round = [r["ratio"][key] for r in rounds]
        defined = [v for v in per_round if v is not None]
        ratios[key] = {
            "median": statistics.median(defined) if defined else None,
            "per_round": per_round,
            "undefined": len(per_round) - len(defined),
        }
    return medians, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=80, help="the whole trace; half is held back")
    parser.add_argument("--request-rate", type=float, default=1.5)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--goodput", nargs="+", default=["ttft:300", "tpot:60"])
    parser.add_argument("--cost", default=str(COST))
    parser.add_argument("--seed", type=int, default=1, help="the trace's seed")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    from jaxllm.bench.serve import parse_goodput

    slos = parse_goodput(args.goodput)
    work = Path(tempfile.mkdtemp(prefix="jaxllm-tune-report-"))
    load = {"before": uptime()}
    started = time.perf_counter()

    whole = work / "trace.jsonl"
    cli(
        *("trace", "synth", "--out", str(whole), "--num-requests", str(args.num_requests)),
        *("--request-rate", str(args.request_rate), "--input-len", str(args.input_len)),
        *("--output-len", str(args.output_len), "--seed", str(args.seed)),
    )
    requests = load_trace(whole)
    half = len(requests) // 2
    tune_part, held = requests[:half], requests[half:]
    held = [dataclasses.replace(r, arrival_time=r.arrival_time - held[0].arrival_time) for r in held]
    save_trace(tune_part, work / "tune.jsonl")
    save_trace(held, work / "held_back.jsonl")

    tuned_json = work / "tune.json"
    cli(
        *("tune", str(work / "tune.jsonl"), "--cost", args.cost, "--goodput", *args.goodput),
        *("--output", str(tuned_json), "--disable-tqdm"),
    )
    tuned = json.loads(tuned_json.read_text())
    chosen = EngineArgs(**tuned["best"])
    searched = list(tuned["search"]["space"])
    default = default_args(chosen, searched)
    settings = {"chosen": chosen, "default": default}

    cost = CostModel.load(args.cost)
    predictions: dict[str, Objective | None] = {
        name: Objective(held, cost, slos, tuned["goodput_fraction"]) if covered(a, cost) else None
        for name, a in settings.items()
    }
    rounds = []
    with (
        ServerProcess(chosen.to_cli_args(), log_path=work / "chosen.log") as chosen_server,
        ServerProcess(default.to_cli_args(), log_path=work / "default.log") as default_server,
    ):
        servers = {"chosen": chosen_server, "default": default_server}
        for round_ in range(args.rounds):
            seed = 100 * (round_ + 1)  # fresh made-up prompt tokens each round; warm-ups use seed + 1, + 2
            order = ["chosen", "default"] if round_ % 2 == 0 else ["default", "chosen"]
            row: dict = {"round": round_, "seed": seed, "order": order, "load": os.getloadavg()[0]}
            for name in order:
                measured = replay(servers[name].url, held, slos, seed=seed, warm_up=round_ == 0)
                row[name] = {"measured": {key: measured[key] for key in KEYS}}
                objective = predictions[name]
                if objective is not None:
                    objective.seed = seed
                    run = objective.run(settings[name])
                    row[name]["predicted"] = {**{key: run.summary[key] for key in KEYS[1:]}, KEYS[0]: run.fraction}
                print(f"round {round_} {name}: " + ", ".join(f"{k} {measured[k]:.3g}" for k in KEYS), flush=True)
            row["ratio"] = {
                key: row["chosen"]["measured"][key] / row["default"]["measured"][key]
                if row["default"]["measured"][key]
                else None
                for key in RATIOS
            }
            rounds.append(row)
    load["after"] = uptime()

    medians, ratios = summarize(rounds, list(settings))
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "load": load,
        "seconds": time.perf_counter() - started,
        "trace": {
            "num_requests": args.num_requests,
            "request_rate": args.request_rate,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "tuned_on": len(tune_part),
            "held_back": len(held),
        },
        "goodput_slos_ms": slos,
        "cost_model": args.cost,
        "tune": {
            "best_setting": tuned["best_setting"],
            "max_request_rate": tuned["predicted"]["max_request_rate"],
            "search": tuned["search"],
            "command": tuned["command"],
        },
        # None: `jaxllm serve`'s own default (on a CPU, 64 sequences and 512-token steps)
        "settings": {name: {k: getattr(a, k) for k in SEARCHABLE if hasattr(a, k)} for name, a in settings.items()},
        "commands": {name: " ".join(["jaxllm", "serve", *a.to_cli_args()]) for name, a in settings.items()},
        "predicted_defaults": "yes"
        if predictions["default"] is not None
        else "no: the defaults' shapes lie beyond the cost model's (extrapolation)",
        "rounds": rounds,
        "median": medians,
        "ratio_chosen_over_default": ratios,
    }
    print(json.dumps({k: result[k] for k in ("load", "settings", "median", "ratio_chosen_over_default")}, indent=1))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        print(f"result JSON: {args.output}")


if __name__ == "__main__":
    main()

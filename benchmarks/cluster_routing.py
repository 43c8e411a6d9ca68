"""Routing policies on real instances, and the cluster simulator's prediction beside each figure.

Two `jaxllm serve` instances of the default model, each pinned to one core of this machine (so the cost model,
calibrated on one pinned core, prices each instance's steps), publish their KV events over ZeroMQ; `jaxllm router
--instances A B --policy P` fronts them; `jaxllm bench serve` replays one multi-turn trace through the router (a
session's turns extend one another; the trace's `session` rides in the `x-session-id` header). Fresh instances for
every policy: each run starts from empty prefix caches, as simulated. Per policy: the instances' prefix-cache hit
rate (from their /metrics, the warm-up request's lookups subtracted), mean and p99 TTFT, goodput under the SLOs.

Beside each real figure, `jaxllm simulate --instances 2 --router P` on the same trace (sim/cluster.py: the same
policy classes, the same made-up token ids, KV events into one prefix index) with the cost model calibrated in the
same round. The simulator does not model the router's own hop (its HTTP proxying and, for prefix_aware, one
/tokenize call per request): the router and the benchmark client float on the two cores the instances are pinned to.

    python benchmarks/cluster_routing.py --rounds 1 --out benchmarks/results/cluster_routing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import httpx

from jaxllm.bench.serve import first_model, parse_goodput
from jaxllm.bench.server_process import ServerProcess, free_port, scrape_metrics
from jaxllm.routing.registry import POLICIES, load_policy
from jaxllm.sim.calibrate import sim_config_for
from jaxllm.sim.cluster import simulate_cluster
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.simulator import cost_model_step_time
from jaxllm.sim.synth import LengthDist, conversations
from jaxllm.sim.trace import save_trace

CLI = [sys.executable, "-m", "jaxllm.entrypoints.cli"]
# each instance: up to 8 sequences, 128-token steps, 512-token contexts (one core prefills ~250 tokens/s of the
# default model: the trace's prompts are short), a KV pool of --num-blocks
MAX_MODEL_LEN = 512
ENGINE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-num-batched-tokens", "128"]
CALIBRATION_KV_BYTES = 400_000_000  # room for calibrate's longest steps (8 sequences of 512 tokens)
METRICS = (
    ("prefix hit rate (%)", "prefix_cache_hit_rate", 100.0),
    ("mean TTFT (ms)", "mean_ttft_ms", 1.0),
    ("p99 TTFT (ms)", "p99_ttft_ms", 1.0),
    ("goodput (req/s)", "request_goodput", 1.0),
)


def make_trace(args: argparse.Namespace) -> list:
    """Multi-turn chat sharing a few system prompts: turn k's prompt holds the session's first k messages."""
    return conversations(
        args.conversations,
        args.turns,
        request_rate=args.conversation_rate,
        turn_len=LengthDist(args.turn_len, "uniform", range_ratio=0.25),
        output_len=LengthDist(args.output_len, "uniform", range_ratio=0.25),
        think_time_s=args.think_time,
        num_prefix_groups=args.system_prompts,
        prefix_len=args.system_prompt_len,
        max_prompt_len=MAX_MODEL_LEN - 2 * args.output_len,  # room for the longest output drawn
        seed=args.seed,
    )


def calibrate(out: Path, kv_bytes: int) -> CostModel:
    """`jaxllm calibrate` on one pinned core, with the instances' flags."""
    subprocess.run(
        [*CLI, "calibrate", "--out", str(out), *ENGINE_FLAGS, "--kv-cache-memory-bytes", str(kv_bytes)],
        check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {0}),
    )
    return CostModel.load(out)


def kv_events_config() -> str:
    """KV events over ZeroMQ on two free loopback ports (events, replay): the router finds them in
    /v1/kv_cache_info."""
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}
    )


def prefix_counters(url: str) -> tuple[float, float]:
    metrics = scrape_metrics(url)
    return metrics.get("jaxllm:prefix_cache_queries_total", 0.0), metrics.get("jaxllm:prefix_cache_hits_total", 0.0)


def run_real(policy: str, trace_path: Path, kv_bytes: int, goodput: list[str], workdir: Path, tag: str) -> dict:
    """Two fresh pinned instances behind a fresh router; the trace replayed through it."""
    flags = [*ENGINE_FLAGS, "--kv-cache-memory-bytes", str(kv_bytes)]
    out = workdir / f"{tag}.bench.json"
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                ServerProcess(
                    [*flags, "--kv-events-config", kv_events_config()],
                    log_path=workdir / f"{tag}.serve{core}.log",
                    cpus={core},
                )
            )
            for core in (0, 1)
        ]
        for server in servers:  # one request outside the trace: a fresh server's first request is slow
            body = {"model": first_model(server.url, {}), "prompt": list(range(100, 148)), "max_tokens": 4}
            httpx.post(server.url + "/v1/completions", json=body, timeout=120).raise_for_status()
        before = [prefix_counters(s.url) for s in servers]
        router_flags = ["--instances", *(s.url for s in servers), "--policy", policy]
        with ServerProcess(router_flags, command="router", log_path=workdir / f"{tag}.router.log") as router:
            bench = ["bench", "serve", "--base-url", router.url, "--dataset-name", "jsonl", "--disable-tqdm"]
            subprocess.run(
                [*CLI, *bench, "--dataset-path", str(trace_path), "--goodput", *goodput, "--output", str(out)],
                check=True,
            )
        after = [prefix_counters(s.url) for s in servers]
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    result = json.loads(out.read_text())
    for key in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "latencies", "errors"):
        result.pop(key, None)
    return {
        **result,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries,
    }


def run_simulated(policy: str, trace: list, cost: CostModel, num_blocks: int, goodput: dict[str, float]) -> dict:
    config = sim_config_for({**cost.engine, "num_blocks": num_blocks})
    run = simulate_cluster(
        trace, config, cost_model_step_time(cost, config), 2, load_policy(policy), **cost.event_costs()
    )
    result = run.to_json(goodput=goodput)
    result.pop("per_instance")
    return result


def table(rounds: list[dict], policies: list[str]) -> tuple[str, dict]:
    lines = ["| policy | metric | real | simulated | error | real, round by round |", "|---|---|---:|---:|---:|---|"]
    rows: dict = {}
    for policy in policies:
        for label, key, scale in METRICS:
            reals = [r["real"][policy][key] * scale for r in rounds]
            sims = [r["simulated"][policy][key] * scale for r in rounds]
            real, sim = statistics.median(reals), statistics.median(sims)
            error = f"{sim - real:+.1f} pt" if scale == 100.0 else f"{sim / real - 1:+.0%}"
            rows.setdefault(policy, {})[key] = {
                "real": real,
                "simulated": sim,
                "real_rounds": reals,
                "sim_rounds": sims,
            }
            lines.append(
                f"| {policy} | {label} | {real:.1f} | {sim:.1f} | {error} | {' / '.join(f'{v:.1f}' for v in reals)} |"
            )
    if "round_robin" in rows and "prefix_aware" in rows:
        ratios = [r["real"]["round_robin"]["mean_ttft_ms"] / r["real"]["prefix_aware"]["mean_ttft_ms"] for r in rounds]
        lines.append("")
        lines.append(
            "round_robin / prefix_aware mean TTFT, real: "
            + " / ".join(f"{x:.2f}x" for x in ratios)
            + f" (median {statistics.median(ratios):.2f}x)"
        )
        rows["ttft_ratio_round_robin_over_prefix_aware"] = ratios
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all four)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds: calibrate, then every policy real + simulated")
    parser.add_argument("--cost", default=None, help="one cost model for every round (default: calibrate each round)")
    parser.add_argument("--num-blocks", type=int, default=256, help="each instance's KV pool, in blocks of 16 tokens")
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--conversation-rate", type=float, default=0.55, help="conversations started per second")
    parser.add_argument("--think-time", type=float, default=5.0, help="mean seconds between a session's turns")
    parser.add_argument("--turn-len", type=int, default=48, help="tokens each turn adds to the conversation")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-prompt-len", type=int, default=64)
    parser.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:100"], metavar="KEY:MS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/cluster_routing", help="writes OUT.md and OUT.json")
    parser.add_argument(
        "--resimulate",
        default=None,
        metavar="OUT.json",
        help="no real runs: simulate again beside an earlier run's real figures (its settings and cost models)",
    )
    args = parser.parse_args()

    if args.resimulate:
        earlier = json.loads(Path(args.resimulate).read_text())
        args = argparse.Namespace(**{**earlier["settings"], "out": args.out, "resimulate": args.resimulate})
    policies = args.policies.split(",")
    for policy in policies:
        load_policy(policy)  # a bad name fails now, not after a calibration
    goodput = parse_goodput(args.goodput)
    trace = make_trace(args)
    if args.resimulate:
        rounds = earlier["rounds"]
        for round_ in rounds:
            cost = CostModel(**round_["cost_model"])
            round_["simulated"] = {p: run_simulated(p, trace, cost, args.num_blocks, goodput) for p in policies}
    else:
        rounds = run_rounds(args, policies, trace, goodput)
    report(args, policies, trace, rounds)


def run_rounds(args: argparse.Namespace, policies: list[str], trace: list, goodput: dict[str, float]) -> list[dict]:
    """Each round: calibrate (or the given cost model), then every policy for real and in the simulator."""
    workdir = Path(tempfile.mkdtemp(prefix="cluster-routing-"))
    save_trace(trace, trace_path := workdir / "trace.jsonl")
    rounds = []
    for round_ in range(args.rounds):
        cost = (
            CostModel.load(args.cost) if args.cost else calibrate(workdir / f"cost.{round_}.json", CALIBRATION_KV_BYTES)
        )
        kv_bytes = args.num_blocks * cost.engine["kv_bytes_per_block"]
        real, simulated = {}, {}
        for policy in policies:
            print(f"round {round_ + 1}: {policy}, load average {os.getloadavg()[0]:.1f}", flush=True)
            real[policy] = run_real(policy, trace_path, kv_bytes, args.goodput, workdir, f"{policy}.{round_}")
            simulated[policy] = run_simulated(policy, trace, cost, args.num_blocks, goodput)
        load = os.getloadavg()[0]
        rounds.append({"cost_model": asdict(cost), "load_average": load, "real": real, "simulated": simulated})
    return rounds


def report(args: argparse.Namespace, policies: list[str], trace: list, rounds: list[dict]) -> None:
    text, rows = table(rounds, policies)
    loads = f"{min(r['load_average'] for r in rounds):.1f}-{max(r['load_average'] for r in rounds):.1f}"
    header = (
        f"Two instances of the default model, each pinned to one core ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), behind `jaxllm router`; {len(trace)} requests: {args.conversations} conversations "
        f"x {args.turns} turns, {args.system_prompts} system prompts of {args.system_prompt_len} tokens, "
        f"{args.turn_len} tokens a turn, {args.output_len} out; {args.num_blocks} KV blocks an instance; goodput SLOs "
        f"{' '.join(args.goodput)}; medians of {args.rounds} round(s); load average {loads} at rounds' ends.\n\n"
    )
    print(header + text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(header + text + "\n")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "resimulate")}
    Path(args.out + ".json").write_text(json.dumps({"settings": settings, "rows": rows, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()

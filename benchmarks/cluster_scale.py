"""The 1,000-instance study: goodput and TTFT against the offered rate, per router policy, in the cluster simulator.

For each offered rate (conversations started per second per instance) one seeded multi-turn trace is made
(`sim.synth.conversations`: 4-turn conversations over shared system prompts, as `jaxllm trace synth --turns 4`)
and run on `--instances` simulated engines behind each policy (sim/cluster.py: the real scheduler and KV manager
per instance, priced by the cost model; the router's own policy classes; KV events into one prefix index). The
same trace goes to every policy: the comparison is paired. Writes OUT.json (every run's summary and wall time)
and OUT_goodput.png, OUT_ttft.png, OUT_hits.png: goodput, mean TTFT and prefix-cache hit rate vs the rate.

    python benchmarks/cluster_scale.py --cost benchmarks/results/cluster_routing_cost.json \
        --instances 1000 --requests-per-instance 40 --rates 0.2,0.4,0.6,0.8 --out benchmarks/results/cluster_scale
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from matplotlib.figure import Figure

from jaxllm.routing.registry import POLICIES, load_policy
from jaxllm.sim.calibrate import sim_config_for
from jaxllm.sim.cluster import simulate_cluster
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.simulator import cost_model_step_time
from jaxllm.sim.synth import LengthDist, conversations

TURNS = 4
CURVES = (
    ("goodput", "request_goodput", "goodput per instance (requests/s within the SLOs)"),
    ("ttft", "mean_ttft_ms", "mean TTFT (ms)"),
    ("hits", "prefix_cache_hit_rate", "prefix-cache hit rate"),
)


def make_trace(args: argparse.Namespace, rate_per_instance: float) -> list:
    num_conversations = args.instances * args.requests_per_instance // TURNS
    return conversations(
        num_conversations,
        TURNS,
        request_rate=rate_per_instance * args.instances,
        turn_len=LengthDist(args.turn_len, "uniform", range_ratio=0.25),
        output_len=LengthDist(args.output_len, "uniform", range_ratio=0.25),
        think_time_s=args.think_time,
        num_prefix_groups=args.system_prompts,
        prefix_len=args.system_prompt_len,
        max_prompt_len=args.max_prompt_len,
        seed=args.seed,
    )


def plot(runs: list[dict], policies: list[str], out: str, title: str, instances: int) -> list[str]:
    paths = []
    for suffix, key, label in CURVES:
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        ax = fig.subplots()
        per = instances if key == "request_goodput" else 1
        for policy in policies:
            points = sorted((r["rate_per_instance"], r["summary"][key] / per) for r in runs if r["policy"] == policy)
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy)
        ax.set_xlabel("offered load (conversations started per second per instance)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        path = f"{out}_{suffix}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost", default=None, help="cost model from `jaxllm calibrate` (needed but with --replot)")
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--requests-per-instance", type=int, default=40)
    parser.add_argument(
        "--rates", default="0.2,0.4,0.6,0.8", help="conversations started per second per instance, comma-separated"
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--prefix-aware-abs-thresholds",
        default="8",
        help="prefix_aware again with each of these balance_abs_threshold values (SGLang's 32 is the default's), "
        "comma-separated; empty: none",
    )
    parser.add_argument("--turn-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--think-time", type=float, default=2.0)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=480)
    parser.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:100"], metavar="KEY:MS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/cluster_scale")
    parser.add_argument("--replot", default=None, metavar="OUT.json", help="only draw the plots of an earlier run")
    args = parser.parse_args()
    if args.replot:
        return replot(args.replot, args.out)
    if args.cost is None:
        parser.error("--cost is needed (a cost model from `jaxllm calibrate`)")

    from jaxllm.bench.serve import parse_goodput

    goodput = parse_goodput(args.goodput)
    variants = {name: (name, {}) for name in args.policies.split(",")}
    for text in filter(None, args.prefix_aware_abs_thresholds.split(",")):
        variants[f"prefix_aware abs {text}"] = ("prefix_aware", {"balance_abs_threshold": int(text)})
    policies = list(variants)
    cost = CostModel.load(args.cost)
    config = sim_config_for(cost.engine)
    step_time = cost_model_step_time(cost, config)
    runs = []
    for rate in (float(r) for r in args.rates.split(",")):
        trace = make_trace(args, rate)
        for policy, (name, options) in variants.items():
            started = time.perf_counter()
            result = simulate_cluster(
                trace,
                config,
                step_time,
                args.instances,
                load_policy(name, **options),
                seed=args.seed,
                **cost.event_costs(),
            ).to_json(goodput=goodput)
            seconds = time.perf_counter() - started
            result.pop("per_instance")
            runs.append({"rate_per_instance": rate, "policy": policy, "wall_s": seconds, "summary": result})
            print(
                f"{rate:g}/s/instance {policy}: {len(trace)} requests in {seconds:.0f} s; goodput "
                f"{result['request_goodput']:.1f} req/s, mean TTFT {result['mean_ttft_ms']:.0f} ms, hits "
                f"{result['prefix_cache_hit_rate']:.0%} (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "replot")}
    Path(args.out + ".json").write_text(json.dumps({"settings": settings, "cost_engine": cost.engine, "runs": runs}))
    print("plots:", ", ".join(plot(runs, policies, args.out, title_of(args), args.instances)))


def title_of(args: argparse.Namespace) -> str:
    return (
        f"{args.instances} simulated instances, {TURNS}-turn conversations over {args.system_prompts} system "
        f"prompts\ncost model {Path(args.cost).name}; SLOs {' '.join(args.goodput)}"
    )


def replot(path: str, out: str) -> None:
    """The plots again from a run's JSON."""
    data = json.loads(Path(path).read_text())
    args = argparse.Namespace(**data["settings"])
    policies = list(dict.fromkeys(r["policy"] for r in data["runs"]))
    print("plots:", ", ".join(plot(data["runs"], policies, out, title_of(args), args.instances)))


if __name__ == "__main__":
    main()

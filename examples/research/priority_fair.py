"""`priority` and `fair` vs `fcfs`: TTFT per request class.

Priority: 20 % of requests are interactive (priority 0), the rest batch (priority 1), under
overload; the `priority` policy (vLLM's) should cut the interactive class's TTFT at the batch
class's expense. Fairness: one tenant floods the engine (a burst of 70 % of the requests) while
three light tenants send steadily; round-robin admission across users (`fair`, a request-count
cousin of VTC, Sheng et al., OSDI 2024) should keep the light tenants' TTFT low, where FCFS makes
them queue behind the flood. Writes priority_fair.png (mean TTFT per class and policy).
"""

import json
from pathlib import Path

from common import capacity, figure, parse_args, run, save, ttfts_ms

from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.synth import LengthDist, merge, synthesize


def main():
    args = parse_args(__doc__.splitlines()[0])
    cost = CostModel.load(args.cost)
    lengths = dict(input_len=LengthDist(64, "uniform"), output_len=LengthDist(48, "uniform"))
    engine_rate = capacity(cost, prompt_len=64, output_len=48)
    mixed = synthesize(400, request_rate=1.5 * engine_rate, num_priorities=5, seed=args.seed, **lengths)
    for r in mixed:  # 20 % interactive (0), 80 % batch (1)
        r.priority = 0 if r.priority == 0 else 1
    flood = synthesize(280, request_rate=10 * engine_rate, seed=args.seed + 1, start=10 / engine_rate, **lengths)
    light = synthesize(120, request_rate=0.5 * engine_rate, num_users=3, seed=args.seed + 2, **lengths)
    for r in flood:
        r.user = "heavy"
    tenants = merge(flood, light)

    summary = {"priority": {}, "fair": {}}
    fig, (pax, fax) = figure(2, 5.5)
    for policy in ("fcfs", "priority"):
        result = run(mixed, cost, policy=policy, seed=args.seed)
        for cls, name in ((0, "interactive"), (1, "batch")):
            ms = ttfts_ms(result, [i for i, r in enumerate(mixed) if r.priority == cls])
            summary["priority"].setdefault(name, {})[policy] = float(ms.mean())
    for policy in ("fcfs", "fair"):
        result = run(tenants, cost, policy=policy, seed=args.seed)
        for name, select in (("heavy", lambda u: u == "heavy"), ("light", lambda u: u != "heavy")):
            ms = ttfts_ms(result, [i for i, r in enumerate(tenants) if select(r.user)])
            summary["fair"].setdefault(name, {})[policy] = float(ms.mean())
    for ax, experiment, policies in ((pax, "priority", ("fcfs", "priority")), (fax, "fair", ("fcfs", "fair"))):
        classes = list(summary[experiment].items())
        width = 0.38
        for k, policy in enumerate(policies):
            ax.bar(
                [i + k * width for i in range(len(classes))],
                [v[policy] / 1000 for _, v in classes],
                width,
                label=policy,
            )
        ax.set_xticks([i + width / 2 for i in range(len(classes))], [c for c, _ in classes])
        ax.set_ylabel("mean TTFT (s)")
        ax.legend()
    pax.set_title("priority: 20 % interactive, 80 % batch")
    fax.set_title("fair: one flooding tenant, three light ones")
    for experiment, classes in summary.items():
        for name, by_policy in classes.items():
            print(f"{experiment:8s} {name:12s} " + "   ".join(f"{p} {v / 1000:6.2f} s" for p, v in by_policy.items()))
    save(fig, Path(args.out) / "priority_fair.png")
    (Path(args.out) / "priority_fair.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
